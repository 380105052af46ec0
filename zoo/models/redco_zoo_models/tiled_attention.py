"""Attention in tiles of keys, with a backward pass that recomputes them (flash attention's
algorithm, in plain JAX): memory linear in the sequence, not quadratic.

Plain attention materialises every query's score against every key, ``(T, S)`` per head, and
keeps it (or its softmax) for the backward pass. Here the keys and values are cut into blocks of
``block`` keys; a scan attends the queries to one block at a time and folds it into a running
softmax (row max ``m``, denominator ``total``, weighted sum), so only ``(T, block)`` scores exist at
once. The forward pass keeps its output and each row's log-sum-exp ``lse = m + log total``; the
backward pass walks the blocks again and recomputes each block's softmax from ``lse``
(``p = exp(s - lse)``), giving the gradients of the queries (summed over blocks) and of the
block's keys and values, never holding more than a block's scores either.

The mask comes from each token's place in its row (``*_rows``, causal: a key at or before the
query) and its segment id (``*_seg``, packed documents: same segment only), so it works the same
on a sequence split over devices in any order (``redco_zoo_models.context_parallel``). A query
whose keys are all masked gets output 0 and ``lse = -inf``: ring attention folds the blocks of
several devices by their ``lse`` (``merge``).

Two options of Gemma 2/3, Qwen3 and Phi-3, as HuggingFace transformers computes them: a sliding
``window`` (a query in row ``i`` sees the keys in rows ``i - window < j <= i``: at most
``window`` keys, itself included) and logit ``softcap`` (each score ``s = q.k * scale`` becomes
``softcap * tanh(s / softcap)`` before the mask and the softmax; the backward pass multiplies the
capped score's gradient by ``1 - tanh(s / softcap)^2``). gpt-oss's attention sinks need no
pass of their own: they rescale the output by its ``lse`` (``with_sinks``), and the backward
pass takes the ``lse``'s gradient.

The XLA path on every backend; on a GPU in 16-bit the zoo's unsplit attention uses cuDNN's
fused kernel instead (``redco_zoo_models.attention.attend``).
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

BLOCK = 512  # keys per tile
_NO_SEGMENT = jnp.iinfo(jnp.int32).min  # the padding keys' segment: no query has it


def _blocks(x, n_blocks: int, block: int, fill=0):
    """(B, S, ...) -> (n_blocks, B, block, ...), padded at the end with ``fill``."""
    pad = n_blocks * block - x.shape[1]
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
    return jnp.moveaxis(x.reshape(x.shape[0], n_blocks, block, *x.shape[2:]), 1, 0)


def _unblock(x, n: int):
    """(n_blocks, B, block, ...) -> (B, n, ...)."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :n]


def _scores(q, k, allowed, scale: float, softcap: float | None):
    """``(scores, slope)``: (B, KV, G, T, block) float32 scores, capped by ``softcap`` (if any)
    and -inf where not ``allowed`` (B, T, block), and the cap's derivative there
    (``1 - tanh^2``; 1 without a cap), which the backward pass needs; ``q`` (B, T, KV, G, D)
    grouped by the key/value head it shares."""
    s = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) * scale
    slope = 1.0
    if softcap is not None:
        s = jnp.tanh(s / softcap)
        s, slope = softcap * s, 1 - s * s
    return jnp.where(allowed[:, None, None], s, -jnp.inf), slope


def _allowed(q_rows, q_seg, k_rows, k_seg, window: int | None):
    """(B, T, block) bools: the keys of the query's segment at or before its row and, with a
    ``window``, fewer than ``window`` rows before it."""
    before = k_rows[:, None, :] - q_rows[:, :, None]  # (B, T, block): <= 0 at or before
    allowed = (before <= 0) & (k_seg[:, None, :] == q_seg[:, :, None])
    return allowed if window is None else allowed & (before > -window)


def _zeros_like(x):
    """float32 zeros shaped like ``x`` and, inside ``shard_map``, varying over the same axes
    (a scan's carry must keep its type)."""
    return x.astype(jnp.float32) * 0


def _safe(m):
    return jnp.where(jnp.isfinite(m), m, 0.0)


def _forward(q, k, v, q_rows, k_rows, q_seg, k_seg, scale, block, window, softcap):
    b, t, h, d = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, t, kv, h // kv, d)
    n_blocks = -(-k.shape[1] // block)
    tiles = (_blocks(k, n_blocks, block), _blocks(v, n_blocks, block),
             _blocks(k_rows, n_blocks, block), _blocks(k_seg, n_blocks, block, _NO_SEGMENT))

    def step(carry, tile):
        m, total, acc = carry  # (B, KV, G, T), (B, KV, G, T), (B, KV, G, T, D)
        kb, vb, rb, sb = tile
        s, _ = _scores(qg, kb, _allowed(q_rows, q_seg, rb, sb, window), scale, softcap)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - _safe(m_new)[..., None])
        rescale = jnp.exp(m - _safe(m_new))
        acc = acc * rescale[..., None] + jnp.einsum("bkgts,bskd->bkgtd", p,
                                                    vb.astype(jnp.float32))
        return (m_new, total * rescale + p.sum(-1), acc), None

    zeros = jnp.moveaxis(_zeros_like(qg), 1, 3)  # (B, KV, G, T, D)
    (m, total, acc), _ = jax.lax.scan(step, (zeros[..., 0] - jnp.inf, zeros[..., 0], zeros), tiles)
    seen = total > 0
    total = jnp.where(seen, total, 1.0)
    out = jnp.where(seen[..., None], acc / total[..., None], 0.0)
    lse = jnp.where(seen, m + jnp.log(total), -jnp.inf)
    out = jnp.moveaxis(out, 3, 1).reshape(b, t, h, d)  # (B, KV, G, T, D) -> (B, T, H, D)
    return out.astype(q.dtype), lse.reshape(b, h, t)


@partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def tiled_attention(q, k, v, q_rows, k_rows, q_seg, k_seg, scale: float, block: int = BLOCK,
                    window: int | None = None, softcap: float | None = None):
    """``(out, lse)``: ``q`` (B, T, H, D) attended to ``k``, ``v`` (B, S, KV, D) (``H`` a
    multiple of ``KV``), a query seeing the keys of its own segment at or before its row (and,
    with a ``window``, after row ``row - window``), the scores capped by ``softcap`` (if any);
    ``lse`` (B, H, T) float32 is each query's log-sum-exp of scores (-inf: no key seen)."""
    return _forward(q, k, v, q_rows, k_rows, q_seg, k_seg, scale, block, window, softcap)


def _tiled_forward(q, k, v, q_rows, k_rows, q_seg, k_seg, scale, block, window, softcap):
    out, lse = _forward(q, k, v, q_rows, k_rows, q_seg, k_seg, scale, block, window, softcap)
    return (out, lse), (q, k, v, q_rows, k_rows, q_seg, k_seg, out, lse)


def _tiled_backward(scale, block, window, softcap, saved, grads):
    q, k, v, q_rows, k_rows, q_seg, k_seg, out, lse = saved
    d_out, d_lse = grads
    b, t, h, d = q.shape
    kv, n = k.shape[2], k.shape[1]
    group = lambda x: jnp.moveaxis(x.reshape(b, t, kv, h // kv, d), 1, 3)  # -> (B,KV,G,T,D)
    qg = q.reshape(b, t, kv, h // kv, d)
    d_out = group(d_out.astype(jnp.float32))
    lse = lse.reshape(b, kv, h // kv, t)
    # d lse / d s = softmax: its gradient joins the usual rowsum(d_out * out) term
    delta = (d_out * group(out.astype(jnp.float32))).sum(-1) - d_lse.reshape(lse.shape)
    n_blocks = -(-n // block)
    tiles = (_blocks(k, n_blocks, block), _blocks(v, n_blocks, block),
             _blocks(k_rows, n_blocks, block), _blocks(k_seg, n_blocks, block, _NO_SEGMENT))

    def step(carry, tile):
        d_q, d_k, d_v = carry
        i, kb, vb, rb, sb = tile
        s, slope = _scores(qg, kb, _allowed(q_rows, q_seg, rb, sb, window), scale, softcap)
        p = jnp.exp(s - _safe(lse)[..., None])  # masked scores: exp(-inf) = 0
        d_s = p * (jnp.einsum("bkgtd,bskd->bkgts", d_out, vb.astype(jnp.float32))
                   - delta[..., None]) * slope * scale  # through the cap, then the scale
        d_q = d_q + jnp.einsum("bkgts,bskd->btkgd", d_s, kb.astype(jnp.float32))
        put = lambda acc, x: jax.lax.dynamic_update_index_in_dim(acc, x, i, 0)
        return (d_q, put(d_k, jnp.einsum("bkgts,btkgd->bskd", d_s, qg.astype(jnp.float32))),
                put(d_v, jnp.einsum("bkgts,bkgtd->bskd", p, d_out))), None

    # the key/value gradients fill buffers made from the keys, not a scan's own zeros: those
    # depend on nothing, and XLA's CPU scheduler allocated every layer's at the step's start
    init = (_zeros_like(qg), _zeros_like(tiles[0]), _zeros_like(tiles[1]))
    (d_q, d_k, d_v), _ = jax.lax.scan(step, init, (jnp.arange(n_blocks), *tiles))
    return (d_q.reshape(q.shape).astype(q.dtype), _unblock(d_k, n).astype(k.dtype),
            _unblock(d_v, n).astype(v.dtype), None, None, None, None)


tiled_attention.defvjp(_tiled_forward, _tiled_backward)


def with_sinks(out, lse, sinks):
    """``out`` (B, T, H, D), a softmax over keys whose log-sum-exp is ``lse`` (B, H, T), as if
    each head's ``sinks`` (H,) logit had joined the denominator with no value (gpt-oss):
    ``out * sigmoid(lse - sink)`` (``exp(lse) / (exp(lse) + exp(sink))``; 0 where no key is
    seen). ``out`` as it is without sinks."""
    if sinks is None:
        return out
    share = jax.nn.sigmoid(lse - sinks.astype(jnp.float32)[None, :, None])  # (B, H, T)
    return (out.astype(jnp.float32) * jnp.moveaxis(share, 1, 2)[..., None]).astype(out.dtype)


def merge(a, b):
    """Two attentions of the same queries to disjoint keys, ``(out, lse)`` each, made one (the
    softmax over all their keys): each weighted by its share ``exp(lse - lse_total)``; the
    output in float32, so that folding many stays exact."""
    (out_a, lse_a), (out_b, lse_b) = a, b
    top = _safe(jnp.maximum(lse_a, lse_b))
    total = jnp.exp(lse_a - top) + jnp.exp(lse_b - top)  # (logaddexp's gradient is nan at -inf)
    lse = jnp.where(total > 0, top + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
    weight = lambda x: jnp.moveaxis(jnp.exp(x - _safe(lse)), 1, 2)[..., None]  # -> (B,T,H,1)
    out = out_a.astype(jnp.float32) * weight(lse_a) + out_b.astype(jnp.float32) * weight(lse_b)
    return out, lse
