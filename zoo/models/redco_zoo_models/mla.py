"""Multi-head latent attention (MLA: DeepSeek-V2 and V3), the decoder's attention where
``kv_lora_rank`` is set.

Keys and values come from a low-rank latent: ``kv_a_proj_with_mqa`` maps each token to a latent
of ``kv_lora_rank`` features (normalised by ``kv_a_layernorm``) plus one ``qk_rope_head_dim``
key part shared by every head; ``kv_b_proj`` expands the latent to each head's key part without
position (``qk_nope_head_dim``) and its value (``v_head_dim``). A head's key is its own part
followed by the shared rotated one. Queries are ``q_proj`` (``q_lora_rank`` None), or a low-rank
``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``, each head's last ``qk_rope_head_dim`` features
rotated. RoPE turns that part only (``head_dim`` is its size); ``rope_interleave`` (DeepSeek's
checkpoints) pairs features (0, 1), (2, 3)... instead of the two halves. Scores are scaled by
``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times YaRN's ``mscale(factor,
mscale_all_dim) ** 2`` where the RoPE is ``yarn`` with ``mscale_all_dim``.

The cache holds each head's full key and value after the up-projection (as a grouped-query
layer's, one per head), not the latent: simple and exact, ``2 * heads * width`` numbers a token
against the latent's ``kv_lora_rank + qk_rope_head_dim``. Queries, keys and values are zero-padded
to one ``width`` (the larger of the key's and the value's size), which changes no score, so the
attention, its tiled and split forms and the cache are the grouped-query layer's.
"""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from redco_zoo_models.context_parallel import attend_laid_out, cached_keys
from redco_zoo_models.layers import RMSNorm
from redco_zoo_models.rope import apply_rope, yarn_mscale

LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm (not the config's rms_norm_eps)


def cached_width(cfg) -> int:
    """The size of each head's cached key and value."""
    return max(cfg.qk_nope_head_dim + cfg.head_dim, cfg.v_head_dim)


def softmax_scale(cfg) -> float:
    scale = (cfg.qk_nope_head_dim + cfg.head_dim) ** -0.5
    rope = cfg.rope
    if rope.kind == "yarn" and rope.get("mscale_all_dim"):
        scale *= yarn_mscale(rope.get("factor"), rope.get("mscale_all_dim")) ** 2
    return scale


def _padded(x, width: int):
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


class LatentAttention(nnx.Module):
    def __init__(self, cfg, rngs: nnx.Rngs):
        d, h, rope = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        linear = lambda i, o, bias=False: nnx.Linear(i, o, use_bias=bias, rngs=rngs)  # noqa: E731
        query = h * (cfg.qk_nope_head_dim + rope)
        if cfg.q_lora_rank:
            self.q_a_proj = linear(d, cfg.q_lora_rank, cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = linear(cfg.q_lora_rank, query)
        else:
            self.q_proj = linear(d, query)
        self.kv_a_proj_with_mqa = linear(d, cfg.kv_lora_rank + rope, cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        self.o_proj = linear(h * cfg.v_head_dim, d, cfg.attention_bias)
        self.cfg = cfg

    def _rotated(self, x, positions, lengths):
        """``x``'s RoPE part (its last ``head_dim`` features) turned, in the halves layout."""
        if self.cfg.rope_interleave:
            x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], -1)
        return apply_rope(x, positions, self.cfg.rope, lengths)

    def _qkv(self, x, positions, lengths):
        cfg, (b, t, _) = self.cfg, x.shape
        h, nope = cfg.num_attention_heads, cfg.qk_nope_head_dim
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if cfg.q_lora_rank \
            else self.q_proj(x)
        q = q.reshape(b, t, h, nope + cfg.head_dim)
        q = jnp.concatenate([q[..., :nope], self._rotated(q[..., nope:], positions, lengths)], -1)
        latent = self.kv_a_proj_with_mqa(x)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent[..., :cfg.kv_lora_rank]))
        kv = kv.reshape(b, t, h, nope + cfg.v_head_dim)
        shared = self._rotated(latent[..., None, cfg.kv_lora_rank:], positions, lengths)
        k = jnp.concatenate([kv[..., :nope], jnp.broadcast_to(shared, (b, t, h, cfg.head_dim))],
                            -1)
        return q, k, kv[..., nope:]

    def __call__(self, x, positions, allowed, layer_cache=None, cache_index=0, lengths=None):
        cfg, (b, t, _) = self.cfg, x.shape
        width = cached_width(cfg)
        q, k, v = (_padded(y, width) for y in self._qkv(x, positions, lengths))
        k, v, layer_cache = cached_keys(layer_cache, k, v, cache_index, allowed)
        out = attend_laid_out(q, k, v, allowed, None, cache_index, scale=softmax_scale(cfg))
        return self.o_proj(out[..., :cfg.v_head_dim].reshape(b, t, -1)), layer_cache
