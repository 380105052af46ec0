"""What every zoo model's attention shares: the masks, a key/value cache, the attention itself.

Slots: a sequence of ``S`` slots holds the prompt (left-padded) and then the generated tokens.
``key_valid`` (B, S) marks the slots holding real tokens. A query in slot ``i`` sees the valid
slots ``<= i`` (causal) or all valid slots (an encoder, cross-attention). Without a cache the
slots are just the input's positions.

A cache is one dict ``{"k": (B, S, KV, D), "v": ...}`` per layer, the model writing a call's
keys and values at ``cache_index`` (the slot of its first token): one slot for every row, or a
(B,) array, each row its own (``redco_zoo_models.engine``: sequences at different lengths
decoded together). A layer whose values are read out of its keys (latent attention,
``redco_zoo_models.mla``) caches ``{"k": ...}`` alone.

Gemma 2/3, Qwen3 and Phi-3 options, as HuggingFace transformers computes them: a sliding window
(a query in slot ``i`` sees only the key slots ``j > i - window``: ``within_window`` restricts a
mask to it, ``attend(..., window=)`` a plain causal one) and logit soft-capping
(``attend(..., softcap=)``: each score ``s`` becomes ``softcap * tanh(s / softcap)`` before the
mask and the softmax). gpt-oss's attention sinks (``attend(..., sinks=)``): a learned logit per
head joins each query's softmax denominator and takes no value, so a query may attend to
"nothing"; with the keys' log-sum-exp ``lse`` that scales the output by ``sigmoid(lse - sink)``
(``tiled_attention.with_sinks``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from redco import remat
from redco_zoo_models.tiled_attention import BLOCK, tiled_attention, with_sinks


def query_slots(first_slot, n_queries: int):
    """``(B or 1, n_queries)``: the slots of ``n_queries`` queries from ``first_slot`` on (a
    number, or a (B,) array: each row's own)."""
    return jnp.reshape(first_slot, (-1, 1)) + jnp.arange(n_queries)


def mask(key_valid, n_queries: int, first_slot=0, causal: bool = True):
    """``(B, 1, T, S)`` bools: which of ``S`` key slots each of ``n_queries`` queries (in slots
    ``first_slot ...``, a number or each row's) may attend to."""
    b, s = key_valid.shape
    allowed = jnp.broadcast_to(key_valid[:, None, None, :], (b, 1, n_queries, s))
    if causal:
        queries = query_slots(first_slot, n_queries)[:, None, :, None]
        allowed = allowed & (jnp.arange(s) <= queries)
    return allowed


def within_window(allowed, window: int | None, first_slot=0):
    """``allowed`` (B, 1, T, S), as ``mask`` or ``decoder_inputs`` give it, restricted to a
    sliding ``window``: query ``i`` (in slot ``first_slot + i``) keeps the key slots
    ``j > first_slot + i - window``, at most ``window`` of them with its own. Unchanged without
    a window (``None``)."""
    if window is None:
        return allowed
    t, s = allowed.shape[-2:]
    queries = query_slots(first_slot, t)[:, None, :, None]
    return allowed & (jnp.arange(s) > queries - window)


def with_blocks(allowed, blocks, n_slots: int):
    """``allowed`` (B, 1, T, S) or ``None`` (plain causal) with each query also seeing every key
    of its own block, both ways: ``blocks`` (B, T) of tokens read into slots ``0..T-1`` (a
    prompt, or training), a block id (>= 0) per token or -1 for none (Gemma 3's bidirectional
    attention within an image). A window (``within_window``) then applies on top."""
    b, t = blocks.shape
    if allowed is None:
        allowed = mask(jnp.ones((b, t), bool), t)
    keys = jnp.pad(blocks, ((0, 0), (0, n_slots - t)), constant_values=-1)
    same = (blocks[:, None, :, None] == keys[:, None, None, :]) & (blocks[:, None, :, None] >= 0)
    return allowed | same


def within_chunk(allowed, chunk: int, positions, first_slot=0):
    """``allowed`` (B, 1, T, S) restricted to each query's chunk of ``chunk`` positions
    (Llama 4's chunked attention): the query in slot ``i`` at position ``p`` keeps the key
    slots ``j >= i - p mod chunk``. A row holds its tokens in consecutive slots (after its left
    padding), so those are the keys at positions ``p - p mod chunk .. p``, its chunk's."""
    start = query_slots(first_slot, positions.shape[1]) - positions % chunk
    return allowed & (jnp.arange(allowed.shape[-1]) >= start[:, None, :, None])


def positions_from(key_valid):
    """Each slot's position in its own sequence: left padding does not count."""
    return jnp.maximum(jnp.cumsum(key_valid, axis=-1) - 1, 0)


def segment_positions(segment_ids):
    """Each token's position in its own document of a packed row: 0 where a new segment id
    starts, counting up within it."""
    b, n = segment_ids.shape
    index = jnp.broadcast_to(jnp.arange(n), (b, n))
    starts = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]],
                             axis=1)
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


def decoder_inputs(batch: int, n: int, attention_mask=None, cached: bool = False,
                   cache_index=0, segment_ids=None):
    """``(positions, allowed)`` of ``n`` new tokens in a decoder. Training (no mask, no cache):
    positions ``0..n-1`` and ``allowed=None``, for a plain causal (fusable) attention; else
    positions that skip left padding and the mask over the key slots (``attention_mask`` covers
    the cache's slots when ``cached``). ``segment_ids`` (B, n) pack several documents in a row
    (equal ids: one document; 0 is padding by convention): a token sees only the earlier tokens
    of its own document, and positions restart at each one."""
    if segment_ids is not None:
        if attention_mask is not None or cached:
            raise ValueError("segment_ids pack documents for training: give them without an "
                             "attention_mask or a cache (padding is its own segment, id 0).")
        same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]  # (B, 1, n, n)
        causal = jnp.arange(n)[None, :] <= jnp.arange(n)[:, None]
        return segment_positions(segment_ids), same & causal
    if attention_mask is None and not cached:
        return jnp.broadcast_to(jnp.arange(n), (batch, n)), None
    key_valid = jnp.ones((batch, n), bool) if attention_mask is None else attention_mask > 0
    slots = jnp.broadcast_to(query_slots(cache_index, n), (batch, n))
    positions = jnp.take_along_axis(positions_from(key_valid), slots, 1)
    return positions, mask(key_valid, n, cache_index)


def init_cache(n_layers: int, batch: int, n_slots: int, n_kv_heads: int, head_dim: int,
               dtype=jnp.float32, values: bool = True) -> list[dict]:
    """An empty cache: keys and (``values``) values of ``n_kv_heads`` x ``head_dim`` a slot."""
    zeros = lambda: jnp.zeros((batch, n_slots, n_kv_heads, head_dim), dtype)  # noqa: E731
    return [{"k": zeros(), "v": zeros()} if values else {"k": zeros()} for _ in range(n_layers)]


def write_cache(layer_cache: dict | None, k, v, cache_index):
    """``(keys, values, new layer cache)``: ``k``, ``v`` written at ``cache_index`` and the whole
    cache attended to; without a cache, just ``k`` and ``v``. ``v`` None: a keys-only cache."""
    if layer_cache is None:
        return k, v, None
    new = {"k": k} if v is None else {"k": k, "v": v}
    written = {name: _write(layer_cache[name], x, cache_index) for name, x in new.items()}
    return written["k"], written.get("v"), written


def _write(cache, new, cache_index):
    """``new`` (B, T, ...) written into ``cache`` (B, S, ...) from slot ``cache_index`` on (a
    number, or a (B,) array: each row's own)."""
    new = new.astype(cache.dtype)
    if jnp.ndim(cache_index) == 0:
        return jax.lax.dynamic_update_slice_in_dim(cache, new, cache_index, 1)
    row = lambda c, x, i: jax.lax.dynamic_update_slice_in_dim(c, x, i, 0)  # noqa: E731
    return jax.vmap(row)(cache, new, cache_index)


def attend(q, k, v, allowed=None, bias=None, scale: float | None = None, is_causal=False,
           window: int | None = None, softcap: float | None = None, sinks=None,
           chunk: int | None = None):
    """``softmax(q k^T * scale + bias)`` over the ``allowed`` keys, times ``v``. ``q`` is
    (B, T, H, D); ``k``, ``v`` (B, S, KV, D) with ``H`` a multiple of ``KV`` (grouped-query
    attention). ``softcap``: the scores capped (``softcap * tanh(s / softcap)``) before the mask.
    ``window``: a sliding window on the plain causal mask (``is_causal``, no ``allowed``): query
    ``i`` sees keys ``i - window < j <= i``; a given ``allowed`` is taken as it is, the window
    already in it (``within_window``); ``chunk`` so cuts the plain causal mask into chunks of
    ``chunk`` rows (``within_chunk``). ``sinks`` (H,): each head's sink logit (module
    docstring). On a GPU in 16-bit with a plain causal mask (no window, cap or sinks), cuDNN's
    flash attention; else a plain causal mask over more than one tile of keys
    runs in tiles (``redco_zoo_models.tiled_attention``: memory linear in the sequence), the
    rest by XLA. The output is named a matmul's (``redco.remat.matmul_output``), so the remat
    policies that keep matmul outputs keep it."""
    out = _attend(q, k, v, allowed, bias, scale, is_causal, window, softcap, sinks, chunk)
    return remat.matmul_output(out)  # o_proj's weight gradient reads it


def _attend(q, k, v, allowed, bias, scale, is_causal, window, softcap, sinks, chunk):
    """``attend`` before its output is named."""
    half = q.dtype in (jnp.bfloat16, jnp.float16)
    fused = half and allowed is None and bias is None and window is None and softcap is None \
        and sinks is None and chunk is None and jax.default_backend() == "gpu"
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if is_causal and not fused and allowed is None and bias is None and \
            q.shape[1] == k.shape[1] > BLOCK:
        rows = jnp.broadcast_to(jnp.arange(q.shape[1]), q.shape[:2])
        segments = rows // chunk if chunk else jnp.zeros(q.shape[:2], jnp.int32)  # (a chunk is
        return with_sinks(*tiled_attention(q, k, v, rows, rows, segments, segments, scale,
                                           window=window, softcap=softcap), sinks)  # a segment)
    if is_causal and allowed is None and (window is not None or chunk):
        causal = mask(jnp.ones((q.shape[0], k.shape[1]), bool), q.shape[1])
        allowed, is_causal = within_window(causal, window), False
        if chunk:
            allowed = within_chunk(allowed, chunk, jnp.broadcast_to(jnp.arange(q.shape[1]),
                                                                    q.shape[:2]))
    if softcap is not None or sinks is not None:
        return _written_out(q, k, v, allowed, bias, scale, is_causal, softcap, sinks)
    return jax.nn.dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype), bias=bias,
                                        mask=allowed, scale=scale, is_causal=is_causal,
                                        implementation="cudnn" if fused else None)


def _written_out(q, k, v, allowed, bias, scale: float, is_causal: bool, softcap: float | None,
                 sinks):
    """``attend`` with capped scores or sinks, written out (XLA's attention has neither): float32
    scores ``q.k * scale (+ bias)``, capped, masked as XLA's attention masks (a large negative,
    so a query with no key averages them all), softmax in float32 over them and each head's
    sink (dropped from the weights)."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, t, kv, h // kv, d)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(q.dtype),
                   preferred_element_type=jnp.float32) * scale
    if bias is not None:
        s = s + jnp.broadcast_to(bias, (b, h, t, k.shape[1])).reshape(s.shape)
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    if is_causal:
        causal = jnp.arange(k.shape[1])[None, :] <= jnp.arange(t)[:, None]
        allowed = causal if allowed is None else allowed & causal
    if allowed is not None:
        allowed = jnp.broadcast_to(allowed, (b, h, t, k.shape[1])).reshape(s.shape)
        s = jnp.where(allowed, s, jnp.finfo(jnp.float32).min)
    if sinks is not None:
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(kv, h // kv, 1, 1),
                                (*s.shape[:-1], 1))
        p = jax.nn.softmax(jnp.concatenate([s, sink], -1), axis=-1)[..., :-1].astype(q.dtype)
    else:
        p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(q.dtype),
                     preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, d).astype(q.dtype)
