"""A LLaMA-style decoder in Flax NNX: RoPE, grouped-query attention, RMSNorm, SwiGLU.

Module names follow HuggingFace's LLaMA (``model/layers/0/self_attn/q_proj/kernel``), so the
``safetensors`` checkpoint format writes names a HuggingFace loader reads.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx


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

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


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


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float):
        self.weight = nnx.Param(jnp.ones((dim,)))
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 ** 2, axis=-1, keepdims=True) + self.eps)
        return (x32 * self.weight[...]).astype(x.dtype)


def apply_rope(x, positions, theta: float):
    """Rotate halves of the last dim of ``x`` (B, T, heads, D) by position-dependent angles."""
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions[..., None].astype(jnp.float32) * freqs  # (B, T, half)
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def attention_implementation(dtype) -> str | None:
    """cuDNN's fused (flash) attention on a GPU in 16-bit, which never materialises the
    T x T scores; XLA's elsewhere (``None`` lets jax choose)."""
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return "cudnn" if half and jax.default_backend() == "gpu" else None


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        d, h, kv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        linear = lambda i, o: nnx.Linear(i, o, use_bias=False, rngs=rngs)
        self.q_proj, self.k_proj = linear(d, h * hd), linear(d, kv * hd)
        self.v_proj, self.o_proj = linear(d, kv * hd), linear(h * hd, d)
        self.cfg = cfg

    def __call__(self, x, positions):
        cfg, (b, t, _) = self.cfg, x.shape
        q = self.q_proj(x).reshape(b, t, cfg.num_attention_heads, cfg.head_dim)
        k = self.k_proj(x).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
        v = self.v_proj(x).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
        q, k = apply_rope(q, positions, cfg.rope_theta), apply_rope(k, positions, cfg.rope_theta)
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                           implementation=attention_implementation(q.dtype))
        return self.o_proj(out.reshape(b, t, -1))


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

    def __call__(self, x, positions):
        x = x + self.self_attn(self.input_layernorm(x), positions)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nnx.Module):
    """The decoder stack, named as HuggingFace names it (``model.layers.0.self_attn...``)."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, rngs) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, input_ids):
        positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1]), input_ids.shape)
        table = self.embed_tokens.embedding[...]  # not nnx.Embed's call: it fixes the dtype
        x = jnp.take(table, input_ids, axis=0)     # at init; this follows the params' dtype
        for layer in self.layers:
            x = layer(x, positions)
        return self.norm(x)


class LlamaForCausalLM(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.model = LlamaModel(cfg, rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Linear(cfg.hidden_size, cfg.vocab_size, use_bias=False, rngs=rngs)

    def __call__(self, input_ids):
        """Logits ``(B, T, vocab)`` for token ids ``(B, T)``."""
        x = self.model(input_ids)
        if self.cfg.tie_word_embeddings:
            return x @ self.model.embed_tokens.embedding[...].T
        return self.lm_head(x)


def generate(apply_fn, params, prompt_ids, max_new_tokens: int, rng, temperature: float = 1.0):
    """Sample ``max_new_tokens`` after ``prompt_ids`` (B, P); greedy when ``temperature == 0``.

    Re-runs the whole fixed-length sequence per token (no KV cache): simple, jittable, and fast
    enough for short samples.
    """
    b, p = prompt_ids.shape
    tokens = jnp.concatenate([prompt_ids, jnp.zeros((b, max_new_tokens), prompt_ids.dtype)], 1)

    def next_token(i, tokens):
        logits = apply_fn(params, tokens)[:, p + i - 1].astype(jnp.float32)
        if temperature == 0:
            token = jnp.argmax(logits, -1)
        else:
            token = jax.random.categorical(jax.random.fold_in(rng, i), logits / temperature)
        return tokens.at[:, p + i].set(token.astype(tokens.dtype))
    return jax.lax.fori_loop(0, max_new_tokens, next_token, tokens)[:, p:]
