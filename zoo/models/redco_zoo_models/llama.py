"""A LLaMA-style decoder in Flax NNX: RoPE, grouped-query attention, RMSNorm, SwiGLU.

Module names follow HuggingFace's LLaMA (``model/layers/0/self_attn/q_proj/kernel``), so the
``safetensors`` checkpoint format writes names a HuggingFace loader reads.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from redco import remat
from redco_zoo_models.attention import attend, init_cache
from redco_zoo_models.chunked_loss import next_token_loss
from redco_zoo_models.context_parallel import (
    SplitSequence,
    cached_keys,
    decoder_layout,
    in_order,
    on_split,
)
from redco_zoo_models.layers import RMSNorm, embed


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    hidden_size: int = 128
    intermediate_size: int = 352
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: biases on q, k, v

    max_position_embeddings: int = 4096  # kept for HuggingFace's config; RoPE has no limit

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, config: dict) -> "LlamaConfig":
        """From a HuggingFace LLaMA, Mistral or Qwen2 ``config.json``."""
        rope = config.get("rope_parameters") or {}  # transformers 5 keeps rope_theta here
        scaled = config.get("rope_scaling") or rope.get("rope_type", "default") != "default"
        if scaled or config.get("head_dim", 0) not in (
                0, None, config["hidden_size"] // config["num_attention_heads"]):
            raise ValueError("RoPE scaling and a head_dim other than hidden/heads are not "
                             "supported by the zoo's LLaMA yet.")
        fields = {f.name for f in dataclasses.fields(cls)} - {"attention_bias"}
        kwargs = {k: v for k, v in {**rope, **config}.items() if k in fields and v is not None}
        kwargs.setdefault("num_key_value_heads", config["num_attention_heads"])
        bias = config.get("attention_bias", config.get("model_type") == "qwen2")
        return cls(**kwargs, attention_bias=bool(bias))

    def to_hf(self) -> dict:
        return {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                "hidden_act": "silu", **dataclasses.asdict(self)}


def _shape(hidden: int, ffn: int, layers: int, heads: int, kv_heads: int | None = None) -> dict:
    return dict(vocab_size=32000, hidden_size=hidden, intermediate_size=ffn,
                num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv_heads or heads)


LLAMA_PRESETS = {  # published shapes, as LlamaConfig fields
    "llama-1b": _shape(2048, 5632, 22, 32, 4),  # TinyLlama-1.1B
    "llama-7b": _shape(4096, 11008, 32, 32),
    "llama-13b": _shape(5120, 13824, 40, 40),
    "llama-30b": _shape(6656, 17920, 60, 52),
    "llama-65b": _shape(8192, 22016, 80, 64),
}


def apply_rope(x, positions, theta: float):
    """Rotate halves of the last dim of ``x`` (B, T, heads, D) by position-dependent angles."""
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions[..., None].astype(jnp.float32) * freqs  # (B, T, half)
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        d, h, kv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        linear = lambda i, o, bias=cfg.attention_bias: nnx.Linear(i, o, use_bias=bias, rngs=rngs)
        self.q_proj, self.k_proj = linear(d, h * hd), linear(d, kv * hd)
        self.v_proj, self.o_proj = linear(d, kv * hd), linear(h * hd, d, bias=False)
        self.cfg = cfg

    def __call__(self, x, positions, allowed, layer_cache=None, cache_index=0):
        cfg, (b, t, _) = self.cfg, x.shape
        q = self.q_proj(x).reshape(b, t, cfg.num_attention_heads, cfg.head_dim)
        k = self.k_proj(x).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
        v = self.v_proj(x).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
        q, k = apply_rope(q, positions, cfg.rope_theta), apply_rope(k, positions, cfg.rope_theta)
        k, v, layer_cache = cached_keys(layer_cache, k, v, cache_index, allowed)
        out = allowed.attend(q, k, v) if isinstance(allowed, SplitSequence) else \
            attend(q, k, v, allowed, is_causal=allowed is None)
        return self.o_proj(out.reshape(b, t, -1)), layer_cache


class MLP(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        linear = lambda i, o: nnx.Linear(i, o, use_bias=False, rngs=rngs)
        self.gate_proj = linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = linear(cfg.intermediate_size, cfg.hidden_size)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, rngs)

    @remat.layer
    def __call__(self, x, positions, allowed, layer_cache=None, cache_index=0):
        h, layer_cache = self.self_attn(self.input_layernorm(x), positions, allowed, layer_cache,
                                        cache_index)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), layer_cache


class LlamaModel(nnx.Module):
    """The decoder stack, named as HuggingFace names it (``model.layers.0.self_attn...``)."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, rngs) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, input_ids, attention_mask=None, cache=None, cache_index=0,
                 segment_ids=None):
        input_ids, positions, allowed = decoder_layout(  # (a split sequence: context parallel)
            input_ids, attention_mask, cache is not None, cache_index, segment_ids)
        x = on_split(embed(self.embed_tokens, input_ids), allowed)
        new_cache = []
        for i, layer in enumerate(self.layers):
            x, layer_cache = layer(x, positions, allowed, cache and cache[i], cache_index)
            new_cache.append(layer_cache)
        return in_order(self.norm(x), allowed), (new_cache if cache is not None else None)


class LlamaForCausalLM(nnx.Module):
    config_class = LlamaConfig

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.model = LlamaModel(cfg, rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Linear(cfg.hidden_size, cfg.vocab_size, use_bias=False, rngs=rngs)

    def __call__(self, input_ids, attention_mask=None, cache=None, cache_index=0,
                 segment_ids=None, labels=None, label_mask=None):
        """Logits ``(B, T, vocab)`` for token ids ``(B, T)``; with a ``cache`` (``init_cache``),
        ``(logits, cache)``. ``attention_mask`` marks real tokens (1) and padding (0) over the
        input, or with a cache over all of its slots; ``segment_ids`` (B, T) pack documents into
        rows, none seeing another (see ``redco_zoo_models.attention``). Given ``labels`` (B, T),
        the mean cross-entropy of predicting them (where ``label_mask``) instead, a chunk of
        tokens at a time: the logits never exist whole (``redco_zoo_models.chunked_loss``)."""
        x, cache = self.model(input_ids, attention_mask, cache, cache_index, segment_ids)
        if labels is not None:
            head = self.model.embed_tokens.embedding[...].T if self.cfg.tie_word_embeddings \
                else self.lm_head.kernel[...]
            return next_token_loss(x, head, labels, label_mask)
        if self.cfg.tie_word_embeddings:
            logits = x @ self.model.embed_tokens.embedding[...].T
        else:
            logits = self.lm_head(x)
        return logits if cache is None else (logits, cache)

    def decode(self, ids, key_valid, cache, cache_index, context=None):
        """One generation step (``redco_zoo_models.generation``)."""
        return self(ids, attention_mask=key_valid, cache=cache, cache_index=cache_index)

    def init_cache(self, batch: int, n_slots: int, dtype=jnp.float32) -> list[dict]:
        cfg = self.cfg
        return init_cache(cfg.num_hidden_layers, batch, n_slots, cfg.num_key_value_heads,
                          cfg.head_dim, dtype)
