"""CLIP's vision tower in Flax NNX, as vision-language models (LLaVA) use it: a pre-norm ViT.

The image is cut into patches (a strided conv without bias), a learned class embedding goes
first and learned positions are added (``vit.patch_sequence``, shared with the zoo's ViT); a
LayerNorm (``pre_layrnorm``, CLIP's spelling) then ``num_hidden_layers`` pre-norm layers
``x + attn(norm1(x))``, ``x + fc2(act(fc1(norm2(x))))`` with full (non-causal) attention scaled
by ``head_dim ** -0.5``. A vision-language model reads one of the hidden states (index 0: the
embeddings after ``pre_layrnorm``; index i: after layer i), not the pooled output, so
``hidden_states`` runs only the layers it needs. ``post_layernorm`` (CLIP's pooled output's) is
kept for the checkpoint's sake. Names follow transformers' ``CLIPVisionModel``.
"""
from __future__ import annotations

import dataclasses

from flax import nnx

from redco import remat
from redco_zoo_models import layer_scan
from redco_zoo_models.attention import attend
from redco_zoo_models.layers import ACTIVATIONS
from redco_zoo_models.vit import patch_sequence

# keys of transformers' CLIPVisionConfig that do not change the forward pass
METADATA = {"model_type", "attention_dropout", "initializer_factor", "initializer_range",
            "projection_dim", "dropout", "dtype", "torch_dtype", "transformers_version",
            "architectures", "vocab_size"}  # (vocab_size: old LLaVA configs carry one)


@dataclasses.dataclass(frozen=True)
class CLIPVisionConfig:
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 32
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5

    MODEL_TYPE = "clip_vision_model"

    @classmethod
    def from_hf(cls, config: dict) -> "CLIPVisionConfig":
        """From a ``MODEL_TYPE`` config (transformers' defaults where a key is missing); a key
        that would change the tower and that it does not read is refused."""
        if config.get("model_type", cls.MODEL_TYPE) != cls.MODEL_TYPE:
            raise ValueError(f"vision_config is a {config['model_type']!r} tower; the zoo reads "
                             f"{cls.MODEL_TYPE} here.")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - fields - METADATA)
        if unknown:
            raise ValueError(f"vision_config has keys the zoo's CLIP tower does not read: "
                             f"{unknown}; remove them if they are off, or convert the model.")
        if config.get("hidden_act", "quick_gelu") not in ACTIVATIONS:
            raise ValueError(f"vision_config's hidden_act {config['hidden_act']!r} is not one of "
                             f"{sorted(ACTIVATIONS)}.")
        return cls(**{k: v for k, v in config.items() if k in fields})

    def to_hf(self) -> dict:
        return {"model_type": self.MODEL_TYPE, **dataclasses.asdict(self)}


class Embeddings(nnx.Module):
    def __init__(self, cfg: CLIPVisionConfig, rngs: nnx.Rngs):
        p, n_patches = (cfg.patch_size, cfg.patch_size), (cfg.image_size // cfg.patch_size) ** 2
        self.class_embedding = nnx.Param(nnx.initializers.normal(1.0)(rngs.params(),
                                                                      (cfg.hidden_size,)))
        self.patch_embedding = nnx.Conv(cfg.num_channels, cfg.hidden_size, p, strides=p,
                                        padding="VALID", use_bias=False, rngs=rngs)
        self.position_embedding = nnx.Embed(n_patches + 1, cfg.hidden_size, rngs=rngs)
        self.image_size = cfg.image_size

    def __call__(self, pixel_values):
        check_pixels(pixel_values, self.image_size)
        return patch_sequence(self.patch_embedding, self.class_embedding[...],
                              self.position_embedding.embedding[...], pixel_values)


def check_pixels(pixel_values, image_size: int) -> None:
    """Refuse images of another shape than the tower's, before anything runs."""
    if pixel_values.ndim != 4 or pixel_values.shape[2:] != (image_size, image_size):
        raise ValueError(f"pixel_values of shape {pixel_values.shape}: the vision tower reads "
                         f"(images, channels, {image_size}, {image_size}); preprocess images "
                         "with the model's own image processor.")


class Attention(nnx.Module):
    def __init__(self, cfg: CLIPVisionConfig, rngs: nnx.Rngs):
        linear = lambda: nnx.Linear(cfg.hidden_size, cfg.hidden_size, rngs=rngs)  # noqa: E731
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (linear() for _ in range(4))
        self.n_heads = cfg.num_attention_heads

    def __call__(self, x):
        q, k, v = (p(x).reshape(*x.shape[:2], self.n_heads, -1)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(attend(q, k, v).reshape(x.shape))


class MLP(nnx.Module):
    def __init__(self, cfg: CLIPVisionConfig, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(cfg.hidden_size, cfg.intermediate_size, rngs=rngs)
        self.fc2 = nnx.Linear(cfg.intermediate_size, cfg.hidden_size, rngs=rngs)
        self.act = cfg.hidden_act

    def __call__(self, x):
        return self.fc2(ACTIVATIONS[self.act](self.fc1(x)))


class Layer(nnx.Module):
    def __init__(self, cfg: CLIPVisionConfig, rngs: nnx.Rngs):
        norm = lambda: nnx.LayerNorm(cfg.hidden_size, epsilon=cfg.layer_norm_eps,  # noqa: E731
                                     rngs=rngs)
        self.layer_norm1, self.layer_norm2 = norm(), norm()
        self.self_attn, self.mlp = Attention(cfg, rngs), MLP(cfg, rngs)

    @remat.layer
    def __call__(self, x):
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nnx.Module):
    def __init__(self, cfg: CLIPVisionConfig, rngs: nnx.Rngs):
        self.layers = nnx.List([Layer(cfg, rngs) for _ in range(cfg.num_hidden_layers)])
        self.runs = None  # stacked by ``stack_blocks``

    def stack_blocks(self) -> None:
        """The layers stored stacked, run under a scan (``layer_scan``; ``scan_layers``)."""
        self.layers, self.runs = layer_scan.stacked(list(self.layers))

    def __call__(self, x):
        """``x`` through every layer: the last hidden state."""
        return layer_scan.blocks(self.layers, self.runs, lambda layer, h: layer(h), x)[0]

    def hidden_states(self, x, n_layers: int) -> list:
        """``[x, after layer 1, ..., after layer n_layers]``. Stacked: every layer runs under
        the scan (those past ``n_layers`` too, unread), its outputs the scan's ``ys``."""
        if self.runs is None:
            layers = list(self.layers)[:n_layers]
            return [x, *layer_scan.blocks(layers, None, lambda layer, h: layer(h), x, True)[1]]
        states = layer_scan.blocks(self.layers, self.runs, lambda layer, h: layer(h), x, True)[1]
        return [x, *states[:n_layers]]


class CLIPVisionModel(nnx.Module):
    """CLIP's vision transformer; ``hidden_states(pixel_values, n)``: its first ``n + 1``
    hidden states."""
    config_class = CLIPVisionConfig

    def __init__(self, cfg: CLIPVisionConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        norm = lambda: nnx.LayerNorm(cfg.hidden_size, epsilon=cfg.layer_norm_eps,  # noqa: E731
                                     rngs=rngs)
        self.embeddings, self.pre_layrnorm = Embeddings(cfg, rngs), norm()
        self.encoder = Encoder(cfg, rngs)
        self.post_layernorm = norm()  # (the pooled output's: unused by vision-language models)

    def hidden_states(self, pixel_values, n_layers: int) -> list:
        """``[embeddings, after layer 1, ..., after layer n_layers]``, each (B, 1 + patches,
        hidden), the class token first, as transformers' ``output_hidden_states``."""
        return self.encoder.hidden_states(self.pre_layrnorm(self.embeddings(pixel_values)),
                                          n_layers)
