"""The shared decoder's grouped-query attention layer (``redco_zoo_models.decoder``): q/k/v
projections (or, Qwen3-Next, a query and an output gate), optional q/k norms (per head, over all
heads, or Llama 4's L2), RoPE of the layer's type (or none), a window or chunks, softcaps and
sinks, a key/value cache. Gemma 4's additions: its full-attention layers' own head size and
key/value heads, values that are the keys' projection (``k_eq_v``) or normalised
(``v_norm``), and layers reading another layer's keys and values (``redco_zoo_models.gemma4``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from redco_zoo_models import llama4_attention
from redco_zoo_models.attention import within_chunk
from redco_zoo_models.context_parallel import attend_laid_out, cached_keys
from redco_zoo_models.decoder_config import DecoderConfig
from redco_zoo_models.layers import RMSNorm, rms_normalized
from redco_zoo_models.rope import apply_rope, pairs_as_halves


class Attention(nnx.Module):
    def __init__(self, cfg: DecoderConfig, layer: int, rngs: nnx.Rngs):
        d, h = cfg.hidden_size, cfg.num_attention_heads
        hd, kv = self.head_dim, self.kv_heads = cfg.attention_shape(layer)
        linear = lambda i, o, bias=cfg.attention_bias: nnx.Linear(i, o, use_bias=bias, rngs=rngs)
        gated = 2 if cfg.attn_output_gate else 1  # (each head's query, then its output gate)
        self.shares = cfg.kv_source(layer) is not None  # Gemma 4: another layer's keys, values
        self.stores = any(cfg.kv_source(j) == layer for j in range(cfg.num_hidden_layers))
        self.k_eq_v = cfg.k_eq_v and not cfg.sliding(layer)  # Gemma 4: values = keys' proj
        self.q_proj, self.o_proj = linear(d, gated * h * hd), linear(h * hd, d, bias=cfg.o_proj_bias)
        if not self.shares:
            self.k_proj = linear(d, kv * hd)
        if not (self.shares or self.k_eq_v):
            self.v_proj = linear(d, kv * hd)
        if cfg.attention_sinks:
            self.sinks = nnx.Param(jnp.zeros((h,), jnp.float32))
        if cfg.qk_norm in ("head", "all"):  # (l2: Llama 4's, without weights)
            per_head = cfg.qk_norm == "head"
            norm = lambda n: RMSNorm(hd if per_head else n * hd, cfg.rms_norm_eps, cfg.norm_offset)
            self.q_norm = norm(h)
            if not self.shares:
                self.k_norm = norm(kv)
        self.cfg = cfg
        self.window = cfg.sliding_window if cfg.sliding(layer) else None
        nope = layer in cfg.nope_layers or cfg.position_embedding != "rope"
        self.rope = None if nope else \
            cfg.local_rope if self.window and cfg.local_rope else cfg.rope
        self.chunk = cfg.attention_chunk_size if layer in cfg.chunked_layers else None

    def _qk(self, x):
        """``(queries, keys, the keys' projection, output gate or None)``; no keys in a layer
        that shares another's."""
        cfg, (b, t, _) = self.cfg, x.shape
        q, gate = self.q_proj(x), None
        k = raw = None if self.shares else self.k_proj(x)
        if k is not None and cfg.key_multiplier != 1.0:  # (Falcon-H1)
            k = k * jnp.asarray(cfg.key_multiplier, k.dtype)
        if cfg.attn_output_gate:
            q, gate = jnp.split(q.reshape(b, t, cfg.num_attention_heads, 2 * self.head_dim), 2, -1)
            q, gate = q.reshape(b, t, -1), gate.reshape(b, t, -1)
        if cfg.qk_norm == "all":
            q, k = self.q_norm(q), k if k is None else self.k_norm(k)
        q = q.reshape(b, t, cfg.num_attention_heads, self.head_dim)
        k = k if k is None else k.reshape(b, t, self.kv_heads, self.head_dim)
        if cfg.qk_norm == "head":
            q, k = self.q_norm(q), k if k is None else self.k_norm(k)
        return q, k, raw, gate

    def _values(self, x, raw):
        """The values: ``v_proj``'s, or (``k_eq_v``) the keys' projection; Gemma 4's
        ``v_norm``: RMS-normalised per head, without weights."""
        (b, t, _), cfg = x.shape, self.cfg
        v = (raw if self.k_eq_v else self.v_proj(x)).reshape(b, t, self.kv_heads, self.head_dim)
        if cfg.v_norm:
            v = rms_normalized(v.astype(jnp.float32), cfg.rms_norm_eps).astype(v.dtype)
        return v

    def __call__(self, x, positions, allowed, layer_cache=None, cache_index=0, lengths=None):
        """``(output, layer cache)``. A layer that shares keys and values reads them from
        ``layer_cache`` (its source's) and returns an empty cache; a layer without a cache
        returns its keys and values as one, for those that share them."""
        cfg, (b, t, _) = self.cfg, x.shape
        q, k, raw, gate = self._qk(x)
        q, k = self._positioned(q, k, positions, cache_index, lengths)
        if self.shares:
            k, v, layer_cache = layer_cache["k"], layer_cache["v"], {}
        else:
            k, v, layer_cache = cached_keys(layer_cache, k, self._values(x, raw), cache_index,
                                            allowed)
            if layer_cache is None and self.stores:
                layer_cache = {"k": k, "v": v}
        if self.chunk and allowed is not None:  # (None: attend's plain causal mask, chunked)
            allowed = within_chunk(allowed, self.chunk, positions, cache_index)
        scale = cfg.attention_multiplier or \
            (cfg.query_pre_attn_scalar and cfg.query_pre_attn_scalar ** -0.5)
        options = dict(scale=scale, softcap=cfg.attn_softcap,
                       sinks=self.sinks[...] if cfg.attention_sinks else None)
        if self.chunk:  # (a split sequence has none: llama4_attention.refuse_split)
            options["chunk"] = self.chunk
        out = attend_laid_out(q, k, v, allowed, self.window, cache_index, **options)
        out = out.reshape(b, t, -1)
        if gate is not None:
            out = out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(out.dtype)
        return self.o_proj(out), layer_cache

    def _positioned(self, q, k, positions, cache_index, lengths):
        """``(q, k)`` turned by RoPE (pairs, Llama 4: ``rope_interleave``; then its L2 norm),
        or, in a NoPE layer, as they are (Llama 4: queries temperature-tuned)."""
        cfg = self.cfg
        if self.rope is None:
            if cfg.attn_temperature_tuning:
                q = llama4_attention.temperature_scaled(q, cache_index, cfg.floor_scale,
                                                        cfg.attn_scale)
            return q, k
        turned = []
        for y in (q, k):  # (k None: a layer that shares another's keys)
            if y is not None and cfg.rope_interleave:
                y = pairs_as_halves(y)
            y = y if y is None else apply_rope(y, positions, self.rope, lengths)
            if y is not None and cfg.qk_norm == "l2":
                y = llama4_attention.l2_normed(y, cfg.rms_norm_eps)
            turned.append(y)
        return tuple(turned)
