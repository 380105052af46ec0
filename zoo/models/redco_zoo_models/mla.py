"""Multi-head latent attention (MLA: DeepSeek-V2 and V3), the decoder's attention where
``kv_lora_rank`` is set.

Keys and values come from a low-rank latent: ``kv_a_proj_with_mqa`` maps each token to a latent
``c`` of ``kv_lora_rank`` (r) features (normalised by ``kv_a_layernorm``) plus one
``qk_rope_head_dim`` key part ``k_r`` shared by every head, rotated; ``kv_b_proj`` expands ``c``
to each head's key part without position (``qk_nope_head_dim``: ``W_UK c``) and its value
(``v_head_dim``: ``W_UV c``). A head's key is its own part followed by the shared rotated one.
Queries are ``q_proj`` (``q_lora_rank`` None), or a low-rank ``q_a_proj``, ``q_a_layernorm``,
``q_b_proj``, each head's last ``qk_rope_head_dim`` features rotated. RoPE turns that part only
(``head_dim`` is its size); ``rope_interleave`` (DeepSeek's checkpoints) pairs features (0, 1),
(2, 3)... instead of the two halves. Scores are scaled by ``(qk_nope_head_dim +
qk_rope_head_dim) ** -0.5``, times YaRN's ``mscale(factor, mscale_all_dim) ** 2`` where the RoPE
is ``yarn`` with ``mscale_all_dim``.

Two forms of one attention:

* **Expanded** (no cache: training, a forward pass): keys and values up-projected per head,
  zero-padded to one width (the larger of the key's and the value's size, which changes no
  score), so the attention, its tiled and context-parallel forms are the grouped-query
  layer's. Per score it costs ``qk_nope_head_dim + qk_rope_head_dim`` multiply-adds.
* **Absorbed** (with a cache: a prompt read into it and each generated token), as DeepSeek's
  own inference, vLLM and SGLang run it: the cache holds per token and layer only ``[c, k_r]``,
  ``kv_lora_rank + qk_rope_head_dim`` numbers (576 for DeepSeek-V3, against
  ``2 x 128 heads x 192`` = 49,152 up-projected). A head's score ``q_nope . W_UK c + q_r . k_r``
  is ``(W_UK^T q_nope) . c + q_r . k_r``, so it is multi-query attention: one shared key
  ``[c, k_r]``, each head's absorbed query ``[W_UK^T q_nope, q_r]``, one shared value ``c``
  (read out of the key: the attention's output past r is dropped), same scale. Each head's
  output latent then goes through its ``W_UV`` and ``o_proj``. ``kv_b_proj`` has no bias, so
  this is exact; a LoRA-adapted ``kv_b_proj`` absorbs its merged matrix.
"""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from redco_zoo_models.context_parallel import attend_laid_out, cached_keys
from redco_zoo_models.layers import RMSNorm
from redco_zoo_models.rope import apply_rope, pairs_as_halves, yarn_mscale

LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm (not the config's rms_norm_eps)


def padded_width(cfg) -> int:
    """The expanded form's one width of queries, keys and values (each zero-padded to it)."""
    return max(cfg.qk_nope_head_dim + cfg.head_dim, cfg.v_head_dim)


def latent_width(cfg) -> int:
    """The numbers the cache holds per token and layer: the latent and the shared RoPE key."""
    return cfg.kv_lora_rank + cfg.head_dim


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
            x = pairs_as_halves(x)
        return apply_rope(x, positions, self.cfg.rope, lengths)

    def _queries(self, x, positions, lengths):
        """(B, T, heads, qk_nope_head_dim + head_dim): each head's query, its RoPE part turned."""
        cfg, (b, t, _) = self.cfg, x.shape
        nope = cfg.qk_nope_head_dim
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if cfg.q_lora_rank \
            else self.q_proj(x)
        q = q.reshape(b, t, cfg.num_attention_heads, nope + cfg.head_dim)
        return jnp.concatenate([q[..., :nope], self._rotated(q[..., nope:], positions, lengths)],
                               -1)

    def _latent(self, x, positions, lengths):
        """``(c, k_r)``: the normalised latent (B, T, r) and the shared key part, turned
        (B, T, 1, head_dim)."""
        latent = self.kv_a_proj_with_mqa(x)
        r = self.cfg.kv_lora_rank
        return (self.kv_a_layernorm(latent[..., :r]),
                self._rotated(latent[..., None, r:], positions, lengths))

    def _up_projection(self):
        """``(W_UK, W_UV)``: ``kv_b_proj``'s matrix per head, (r, heads, qk_nope_head_dim) and
        (r, heads, v_head_dim); a LoRA layer's merged (``redco_zoo_models.lora``)."""
        cfg, up = self.cfg, self.kv_b_proj
        kernel = (up.merged() if hasattr(up, "merged") else up).kernel[...]
        kernel = kernel.reshape(cfg.kv_lora_rank, cfg.num_attention_heads, -1)
        return kernel[..., :cfg.qk_nope_head_dim], kernel[..., cfg.qk_nope_head_dim:]

    def _expanded(self, q, c, k_r, allowed):
        """Each head's attention output (B, T, heads, v_head_dim), keys and values
        up-projected (no cache)."""
        cfg, (b, t, h, _) = self.cfg, q.shape
        nope, width = cfg.qk_nope_head_dim, padded_width(cfg)
        kv = self.kv_b_proj(c).reshape(b, t, h, nope + cfg.v_head_dim)
        k = jnp.concatenate([kv[..., :nope], jnp.broadcast_to(k_r, (b, t, h, cfg.head_dim))], -1)
        q, k, v = (_padded(y, width) for y in (q, k, kv[..., nope:]))
        out = attend_laid_out(q, k, v, allowed, None, scale=softmax_scale(cfg))
        return out[..., :cfg.v_head_dim]

    def _absorbed(self, q, c, k_r, allowed, layer_cache, cache_index):
        """``(output (B, T, heads, v_head_dim), cache)``: ``[c, k_r]`` cached, the attention
        multi-query over it with ``W_UK`` absorbed into the queries, ``W_UV`` applied after."""
        cfg, nope, r = self.cfg, self.cfg.qk_nope_head_dim, self.cfg.kv_lora_rank
        w_uk, w_uv = self._up_projection()
        q = jnp.concatenate([jnp.einsum("bthn,rhn->bthr", q[..., :nope], w_uk.astype(q.dtype)),
                             q[..., nope:]], -1)
        key = jnp.concatenate([c[:, :, None], k_r], -1)  # (B, T, 1, r + head_dim)
        key, _, layer_cache = cached_keys(layer_cache, key, None, cache_index, allowed)
        out = attend_laid_out(q, key, key, allowed, None, cache_index, scale=softmax_scale(cfg))
        return jnp.einsum("bthr,rhv->bthv", out[..., :r], w_uv.astype(out.dtype)), layer_cache

    def __call__(self, x, positions, allowed, layer_cache=None, cache_index=0, lengths=None):
        q, (c, k_r) = self._queries(x, positions, lengths), self._latent(x, positions, lengths)
        if layer_cache is None:
            out = self._expanded(q, c, k_r, allowed)
        else:
            out, layer_cache = self._absorbed(q, c, k_r, allowed, layer_cache, cache_index)
        return self.o_proj(out.reshape(*x.shape[:2], -1)), layer_cache
