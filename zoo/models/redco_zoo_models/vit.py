"""A ViT encoder in Flax NNX: patches, a class token, learned positions, pre-norm layers.

Module names follow the checkpoints HuggingFace writes for ViT
(``encoder/layer/0/attention/attention/query/kernel``, ``embeddings/patch_embeddings/projection``).
Images come as HuggingFace's ``pixel_values`` (B, C, H, W).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from redco import remat
from redco_zoo_models.attention import attend
from redco_zoo_models.layers import ACTIVATIONS


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-12
    image_size: int = 224
    patch_size: int = 16
    num_channels: int = 3
    qkv_bias: bool = True
    pooler_output_size: int | None = None  # hidden_size
    pooler_act: str = "tanh"

    @classmethod
    def from_hf(cls, config: dict) -> "ViTConfig":
        """From a HuggingFace ViT ``config.json`` (its defaults where a key is missing)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in config.items() if k in fields}
        for key in ("image_size", "patch_size"):  # (h, w) pairs: square only
            if isinstance(kwargs.get(key), (list, tuple)):
                if len(set(kwargs[key])) != 1:
                    raise ValueError(f"non-square {key} {kwargs[key]} is not supported")
                kwargs[key] = kwargs[key][0]
        return cls(**kwargs)

    def to_hf(self) -> dict:
        return {"model_type": "vit", "architectures": ["ViTModel"], **dataclasses.asdict(self),
                "pooler_output_size": self.pooler_output_size or self.hidden_size}


class Dense(nnx.Module):
    """A holder of one ``dense`` layer, as HuggingFace nests them (``intermediate.dense``)."""

    def __init__(self, n_in: int, n_out: int, rngs: nnx.Rngs):
        self.dense = nnx.Linear(n_in, n_out, rngs=rngs)


class SelfAttention(nnx.Module):
    def __init__(self, cfg: ViTConfig, rngs: nnx.Rngs):
        linear = lambda: nnx.Linear(cfg.hidden_size, cfg.hidden_size, use_bias=cfg.qkv_bias,
                                    rngs=rngs)
        self.query, self.key, self.value = linear(), linear(), linear()
        self.n_heads = cfg.num_attention_heads

    def __call__(self, x):
        q, k, v = (p(x).reshape(*x.shape[:2], self.n_heads, -1)
                   for p in (self.query, self.key, self.value))
        return attend(q, k, v).reshape(x.shape)


class Attention(nnx.Module):
    def __init__(self, cfg: ViTConfig, rngs: nnx.Rngs):
        self.attention = SelfAttention(cfg, rngs)
        self.output = Dense(cfg.hidden_size, cfg.hidden_size, rngs)


class Layer(nnx.Module):
    def __init__(self, cfg: ViTConfig, rngs: nnx.Rngs):
        norm = lambda: nnx.LayerNorm(cfg.hidden_size, epsilon=cfg.layer_norm_eps, rngs=rngs)
        self.layernorm_before, self.layernorm_after = norm(), norm()
        self.attention = Attention(cfg, rngs)
        self.intermediate = Dense(cfg.hidden_size, cfg.intermediate_size, rngs)
        self.output = Dense(cfg.intermediate_size, cfg.hidden_size, rngs)
        self.activation = cfg.hidden_act

    @remat.layer
    def __call__(self, x):
        x = x + self.attention.output.dense(self.attention.attention(self.layernorm_before(x)))
        h = ACTIVATIONS[self.activation](self.intermediate.dense(self.layernorm_after(x)))
        return x + self.output.dense(h)


class Encoder(nnx.Module):
    def __init__(self, cfg: ViTConfig, rngs: nnx.Rngs):
        self.layer = nnx.List([Layer(cfg, rngs) for _ in range(cfg.num_hidden_layers)])


class PatchEmbeddings(nnx.Module):
    def __init__(self, cfg: ViTConfig, rngs: nnx.Rngs):
        p = (cfg.patch_size, cfg.patch_size)
        self.projection = nnx.Conv(cfg.num_channels, cfg.hidden_size, p, strides=p,
                                   padding="VALID", rngs=rngs)


class Embeddings(nnx.Module):
    def __init__(self, cfg: ViTConfig, rngs: nnx.Rngs):
        n_patches = (cfg.image_size // cfg.patch_size) ** 2
        init = nnx.initializers.truncated_normal(0.02)
        self.cls_token = nnx.Param(init(rngs.params(), (1, 1, cfg.hidden_size)))
        self.position_embeddings = nnx.Param(init(rngs.params(), (1, n_patches + 1,
                                                                  cfg.hidden_size)))
        self.patch_embeddings = PatchEmbeddings(cfg, rngs)

    def __call__(self, pixel_values):
        return patch_sequence(self.patch_embeddings.projection, self.cls_token[...],
                              self.position_embeddings[...], pixel_values)


def patch_sequence(projection: nnx.Conv, cls, positions, pixel_values):
    """``(B, 1 + patches, hidden)``: ``pixel_values`` (B, C, H, W) cut into patches by the
    strided conv ``projection``, in row-major order behind the class token ``cls`` (hidden,;
    ``None``: none, as SigLIP), plus the learned ``positions`` (1 + patches, hidden); ViT's,
    CLIP's and SigLIP's embeddings."""
    x = projection(pixel_values.transpose(0, 2, 3, 1).astype(positions.dtype))
    x = x.reshape(x.shape[0], -1, x.shape[-1])  # (B, patches in row-major order, hidden)
    if cls is not None:
        x = jnp.concatenate([jnp.broadcast_to(cls, (x.shape[0], 1, x.shape[-1])), x], 1)
    return x + positions


class ViTModel(nnx.Module):
    """``__call__(pixel_values)``: the last hidden states (B, 1 + patches, hidden), the class
    token first. With ``add_pooling_layer`` (HuggingFace's default, which VisionEncoderDecoder
    keeps) a ``pooler`` too, applied by ``pool``."""
    config_class = ViTConfig

    def __init__(self, cfg: ViTConfig, rngs: nnx.Rngs, add_pooling_layer: bool = True):
        self.cfg = cfg
        self.embeddings = Embeddings(cfg, rngs)
        self.encoder = Encoder(cfg, rngs)
        self.layernorm = nnx.LayerNorm(cfg.hidden_size, epsilon=cfg.layer_norm_eps, rngs=rngs)
        if add_pooling_layer:
            self.pooler = Dense(cfg.hidden_size, cfg.pooler_output_size or cfg.hidden_size, rngs)

    def __call__(self, pixel_values):
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layer:
            x = layer(x)
        return self.layernorm(x)

    def pool(self, hidden_states):
        """HuggingFace's ``pooler_output``: the class token's state through ``pooler``."""
        return ACTIVATIONS[self.cfg.pooler_act](self.pooler.dense(hidden_states[:, 0]))
