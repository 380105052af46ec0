"""T5 in Flax NNX: an encoder-decoder with a bucketed relative position bias and RMS norms.

Covers T5 v1.0 (ReLU, ``lm_head`` tied to ``shared``, decoder output scaled by ``d_model**-0.5``)
and T5 v1.1 / flan-T5 (``feed_forward_proj="gated-gelu"``, separate ``lm_head``). Modules are
named as HuggingFace's PyTorch T5 names them (``encoder/block/0/layer/0/SelfAttention/q``).
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from flax import nnx

from redco import remat
from redco_zoo_models import layers
from redco_zoo_models.attention import attend, init_cache, mask, write_cache
from redco_zoo_models.layers import ACTIVATIONS, RMSNorm


@dataclasses.dataclass(frozen=True)
class T5Config:
    vocab_size: int = 256
    d_model: int = 64
    d_kv: int = 16
    d_ff: int = 128
    num_layers: int = 2
    num_decoder_layers: int | None = None  # None: num_layers
    num_heads: int = 4
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "relu"  # or "gated-gelu" (T5 v1.1, flan-T5)
    tie_word_embeddings: bool = True  # lm_head is `shared`
    scale_decoder_outputs: bool | None = None  # by d_model**-0.5; None: tie_word_embeddings
    pad_token_id: int = 0
    eos_token_id: int | tuple | None = 1
    decoder_start_token_id: int = 0

    @property
    def decoder_layers(self) -> int:
        return self.num_decoder_layers or self.num_layers

    @property
    def scale_output(self) -> bool:
        scale = self.scale_decoder_outputs
        return self.tie_word_embeddings if scale is None else scale

    @property
    def activation(self):
        act = self.feed_forward_proj.split("-")[-1]
        return ACTIVATIONS["gelu_new" if self.feed_forward_proj == "gated-gelu" else act]

    @classmethod
    def from_hf(cls, config: dict) -> "T5Config":
        """From a HuggingFace T5 ``config.json``. transformers 5 always writes
        ``tie_word_embeddings: true`` along with ``scale_decoder_outputs``; there, as in T5 v1.0
        and v1.1, a scaled output means a tied head."""
        kwargs = {f.name: config[f.name] for f in dataclasses.fields(cls)
                  if config.get(f.name) is not None}
        if isinstance(kwargs.get("eos_token_id"), list):
            kwargs["eos_token_id"] = tuple(kwargs["eos_token_id"])
        if "scale_decoder_outputs" in kwargs:
            kwargs["tie_word_embeddings"] = kwargs["scale_decoder_outputs"]
        return cls(**kwargs)

    def to_hf(self) -> dict:
        return {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"],
                "is_encoder_decoder": True, **dataclasses.asdict(self),
                "num_decoder_layers": self.decoder_layers,
                "scale_decoder_outputs": self.scale_output}


def relative_buckets(relative, bidirectional: bool, num_buckets: int, max_distance: int):
    """Mesh TensorFlow's buckets of ``key - query`` slot distances: exact when small, then
    logarithmic up to ``max_distance``; a decoder sees only ``<= 0``."""
    buckets = 0
    if bidirectional:
        num_buckets //= 2
        buckets = (relative > 0).astype(jnp.int32) * num_buckets
        relative = jnp.abs(relative)
    else:
        relative = -jnp.minimum(relative, 0)
    max_exact = num_buckets // 2
    large = max_exact + (jnp.log(jnp.maximum(relative, 1).astype(jnp.float32) / max_exact)
                         / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).astype(jnp.int32)
    large = jnp.minimum(large, num_buckets - 1)
    return buckets + jnp.where(relative < max_exact, relative, large)


class T5Attention(nnx.Module):
    def __init__(self, cfg: T5Config, has_relative_attention_bias: bool, rngs: nnx.Rngs):
        inner = cfg.num_heads * cfg.d_kv
        linear = lambda i, o, **kw: nnx.Linear(i, o, use_bias=False, rngs=rngs, **kw)
        # Mesh TensorFlow folds attention's 1/sqrt(d_kv) into q's init (T5 scores are unscaled)
        q_init = nnx.initializers.normal((cfg.d_model * cfg.d_kv) ** -0.5)
        self.q = linear(cfg.d_model, inner, kernel_init=q_init)
        self.k, self.v = linear(cfg.d_model, inner), linear(cfg.d_model, inner)
        self.o = linear(inner, cfg.d_model)
        if has_relative_attention_bias:
            self.relative_attention_bias = nnx.Embed(cfg.relative_attention_num_buckets,
                                                     cfg.num_heads, rngs=rngs)
        self.cfg = cfg

    def bias(self, query_slots, key_slots, bidirectional: bool):
        """``(1, heads, T, S)``: the additive bias of queries in ``query_slots`` on keys."""
        cfg = self.cfg
        buckets = relative_buckets(key_slots[None, :] - query_slots[:, None], bidirectional,
                                   cfg.relative_attention_num_buckets,
                                   cfg.relative_attention_max_distance)
        return jnp.take(self.relative_attention_bias.embedding[...], buckets, 0).transpose(2, 0, 1)[None]

    def __call__(self, x, kv, allowed, bias=None, layer_cache=None, cache_index=0):
        split = lambda y: y.reshape(*y.shape[:2], self.cfg.num_heads, self.cfg.d_kv)
        k, v, layer_cache = write_cache(layer_cache, split(self.k(kv)), split(self.v(kv)),
                                        cache_index)
        out = attend(split(self.q(x)), k, v, allowed, bias, scale=1.0)
        return self.o(out.reshape(*x.shape[:2], -1)), layer_cache


class T5LayerSelfAttention(nnx.Module):
    def __init__(self, cfg: T5Config, has_relative_attention_bias: bool, rngs: nnx.Rngs):
        self.SelfAttention = T5Attention(cfg, has_relative_attention_bias, rngs)
        self.layer_norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)

    def __call__(self, x, allowed, bias, layer_cache=None, cache_index=0):
        h = self.layer_norm(x)
        h, layer_cache = self.SelfAttention(h, h, allowed, bias, layer_cache, cache_index)
        return x + h, layer_cache


class T5LayerCrossAttention(nnx.Module):
    def __init__(self, cfg: T5Config, rngs: nnx.Rngs):
        self.EncDecAttention = T5Attention(cfg, False, rngs)
        self.layer_norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)

    def __call__(self, x, context, allowed):
        return x + self.EncDecAttention(self.layer_norm(x), context, allowed)[0]


class T5DenseReluDense(nnx.Module):
    """``wo(act(wi x))``, or gated: ``wo(act(wi_0 x) * wi_1 x)``."""

    def __init__(self, cfg: T5Config, rngs: nnx.Rngs):
        linear = lambda i, o: nnx.Linear(i, o, use_bias=False, rngs=rngs)
        self.gated = cfg.feed_forward_proj.startswith("gated-")
        if self.gated:
            self.wi_0, self.wi_1 = linear(cfg.d_model, cfg.d_ff), linear(cfg.d_model, cfg.d_ff)
        else:
            self.wi = linear(cfg.d_model, cfg.d_ff)
        self.wo = linear(cfg.d_ff, cfg.d_model)
        self.act = cfg.activation

    def __call__(self, x):
        h = self.act(self.wi_0(x)) * self.wi_1(x) if self.gated else self.act(self.wi(x))
        return self.wo(h)


class T5LayerFF(nnx.Module):
    def __init__(self, cfg: T5Config, rngs: nnx.Rngs):
        self.DenseReluDense = T5DenseReluDense(cfg, rngs)
        self.layer_norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)

    def __call__(self, x):
        return x + self.DenseReluDense(self.layer_norm(x))


class T5Block(nnx.Module):
    def __init__(self, cfg: T5Config, is_decoder: bool, has_relative_attention_bias: bool,
                 rngs: nnx.Rngs):
        layers = [T5LayerSelfAttention(cfg, has_relative_attention_bias, rngs)]
        layers += [T5LayerCrossAttention(cfg, rngs)] if is_decoder else []
        self.layer = nnx.List(layers + [T5LayerFF(cfg, rngs)])

    @remat.layer
    def __call__(self, x, allowed, bias, layer_cache=None, cache_index=0, context=None,
                 cross_allowed=None):
        x, layer_cache = self.layer[0](x, allowed, bias, layer_cache, cache_index)
        if context is not None:
            x = self.layer[1](x, context, cross_allowed)
        return self.layer[-1](x), layer_cache


class T5Stack(nnx.Module):
    """The encoder or the decoder; the first block's self-attention owns the position bias."""

    def __init__(self, cfg: T5Config, is_decoder: bool, rngs: nnx.Rngs):
        n = cfg.decoder_layers if is_decoder else cfg.num_layers
        self.block = nnx.List([T5Block(cfg, is_decoder, i == 0, rngs) for i in range(n)])
        self.final_layer_norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)
        self.is_decoder = is_decoder

    def __call__(self, x, allowed, query_slots, key_slots, context=None, cross_allowed=None,
                 cache=None, cache_index=0):
        bias = self.block[0].layer[0].SelfAttention.bias(query_slots, key_slots,
                                                         not self.is_decoder)
        new_cache = []
        for i, block in enumerate(self.block):
            x, layer_cache = block(x, allowed, bias, cache and cache[i], cache_index, context,
                                   cross_allowed)
            new_cache.append(layer_cache)
        return self.final_layer_norm(x), (new_cache if cache is not None else None)


class T5ForConditionalGeneration(nnx.Module):
    config_class = T5Config
    hf_tied_weights = {"lm_head.weight": "shared.weight"}  # untied but never trained in HF

    def __init__(self, cfg: T5Config, rngs: nnx.Rngs):
        self.cfg = cfg
        self.shared = nnx.Embed(cfg.vocab_size, cfg.d_model, rngs=rngs,
                                embedding_init=nnx.initializers.normal(1.0))  # as HF's T5
        self.encoder = T5Stack(cfg, False, rngs)
        self.decoder = T5Stack(cfg, True, rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, rngs=rngs)

    def embed(self, ids):
        return layers.embed(self.shared, ids)

    def encode(self, input_ids, attention_mask=None) -> dict:
        """The decoder's context: the encoder's hidden states and which source tokens are real."""
        valid = jnp.ones(input_ids.shape, bool) if attention_mask is None else attention_mask > 0
        slots = jnp.arange(input_ids.shape[1])
        hidden, _ = self.encoder(self.embed(input_ids), mask(valid, len(slots), causal=False),
                                 slots, slots)
        return {"hidden_states": hidden, "attention_mask": valid}

    def decode(self, ids, key_valid, cache, cache_index, context: dict):
        """Logits ``(B, T, vocab)`` for decoder ``ids`` in the slots from ``cache_index`` on, and
        the cache (``redco_zoo_models.generation``); without a cache, the slots are the ids'."""
        t = ids.shape[1]
        query_slots = cache_index + jnp.arange(t)
        key_slots = jnp.arange(key_valid.shape[1])
        cross = mask(context["attention_mask"], t, causal=False)
        x, cache = self.decoder(self.embed(ids), mask(key_valid > 0, t, cache_index),
                                query_slots, key_slots, context["hidden_states"], cross, cache,
                                cache_index)
        if self.cfg.scale_output:
            x = x * self.cfg.d_model ** -0.5
        if self.cfg.tie_word_embeddings:
            return x @ self.shared.embedding[...].T, cache
        return self.lm_head(x), cache

    def __call__(self, input_ids, attention_mask, decoder_input_ids, decoder_attention_mask=None):
        """Logits ``(B, T, vocab)`` over ``decoder_input_ids`` (teacher forcing)."""
        if decoder_attention_mask is None:
            decoder_attention_mask = jnp.ones(decoder_input_ids.shape, bool)
        context = self.encode(input_ids, attention_mask)
        return self.decode(decoder_input_ids, decoder_attention_mask, None, 0, context)[0]

    def init_cache(self, batch: int, n_slots: int, dtype=jnp.float32) -> list[dict]:
        cfg = self.cfg
        return init_cache(cfg.decoder_layers, batch, n_slots, cfg.num_heads, cfg.d_kv, dtype)
