"""Gated DeltaNet: the linear-attention token mixer of Qwen3-Next and Qwen3.5's
``linear_attention`` layers, a fixed-size state per head in place of a key/value cache.

**Projections** (as the checkpoint has them, Qwen3.5's names): ``in_proj_qkv`` gives queries and
keys (``n_key_heads`` x ``key_head_dim`` each) and values (``n_value_heads`` x
``value_head_dim``); ``in_proj_z`` the output gate ``z`` (one per value channel); ``in_proj_b``
and ``in_proj_a`` one number per value head each. Qwen3-Next fuses them per key head
(``in_proj_qkvz``, ``in_proj_ba``): ``redco_zoo_models.family_tensors`` splits them on import.
A value head ``h`` reads query/key head ``h // (n_value_heads / n_key_heads)``.

**Short convolution.** q, k and v (concatenated, ``C`` channels) go through a causal depthwise
convolution of width ``conv_kernel`` (``conv1d/weight`` (C, 1, K), no bias: each channel's
output at ``t`` is ``sum_j w[j] x[t - K + 1 + j]``, zeros before the start), then SiLU. Decoding
keeps the last ``K - 1`` inputs as its conv state.

**The gated delta rule.** q and k are L2-normalised, q scaled by ``key_head_dim ** -0.5``;
``beta_t = sigmoid(b_t)`` (the write strength) and the log-decay
``g_t = -exp(A_log) * softplus(a_t + dt_bias)`` (<= 0). A state ``S`` (key_dim x value_dim per
head, starting at 0) is, token by token::

    S = exp(g_t) S;   S = S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t

the delta rule (the value ``S`` predicts for ``k_t`` moved toward ``v_t``) with a forgetting gate.
``recurrent`` computes exactly that under ``jax.lax.scan``: decoding, and the cross-check.
``chunked`` (training, prefill) cuts the sequence into chunks of ``chunk_size``. Within a
chunk, with ``G_i`` the cumulative log-decay from the chunk's start and ``L = I + A`` where
``A_ij = beta_i k_i.k_j exp(G_i - G_j)`` for ``j < i``, the chunk's writes are
``U = L^-1 (beta v)`` less what the incoming state already gives, ``W = L^-1 (beta k exp(G))``
(``unit_lower_inverse``: the WY form of the delta rule's products of
``I - beta k k^T``). Then with the incoming state ``S``::

    V' = U - W S;   O = (q exp(G)) S + (q k^T * exp(G_i - G_j), j <= i) V'
    S  = exp(G_last) S + (k exp(G_last - G))^T V'

Everything but the last two lines runs for all chunks at once; those are a ``jax.lax.scan`` over
the chunks carrying ``S``. Both run in float32.

**Packed rows** (several documents in a row, ``segment_ids``), as ``mamba2`` does: the
convolution reads no other document's inputs; within a chunk ``A`` and the decays between two
documents' tokens are zero; the state entering a chunk reaches (through ``q exp(G)`` and
``W``) only the tokens of its own document, and a chunk that ends in a new document passes on
that document's state alone. Each document computes what it computes alone.

**Output.** Each value head's output is RMS-normalised, scaled by ``norm/weight`` and multiplied
by ``silu(z)`` (the gated RMSNorm), then ``out_proj``.

**Padding.** Padded inputs are zeroed before the projections (as transformers does), and a
padded token neither decays nor writes the state (``g = 0``, ``beta = 0``): a left pad leaves
the zero state and the convolution sees zeros, as before the start; right padding (the serving
engine's prefill) leaves the state where the row's last real token left it, and the conv state
keeps the last real inputs (``layers.last_real_inputs``).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from redco_zoo_models import mamba2, recurrent_split
from redco_zoo_models.layers import last_real_inputs


@dataclasses.dataclass(frozen=True)
class DeltaNetConfig:
    hidden_size: int
    n_key_heads: int
    n_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4
    eps: float = 1e-6  # the gated RMSNorm's
    chunk_size: int = 64  # tokens a chunk of the chunked rule (a run's choice, no config key)

    def __post_init__(self):
        if self.n_value_heads % self.n_key_heads:
            raise ValueError(f"linear_num_value_heads={self.n_value_heads} is not a multiple of "
                             f"linear_num_key_heads={self.n_key_heads}: each key head serves "
                             "a whole group of value heads.")

    @property
    def key_dim(self) -> int:
        return self.n_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.n_value_heads * self.value_head_dim


def l2norm(x, eps: float = 1e-6):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def causal_conv(x, weight, state=None, runs=None):
    """``silu(conv(x))``: ``x`` (B, T, C), ``weight`` (C, 1, K), ``state`` (B, K-1, C) the inputs
    before ``x`` (``None``: zeros, the sequence's start); ``runs`` (B, T): packed documents
    (``layers.document_runs``), a token reading no other document's inputs."""
    history = None if state is None else state.astype(x.dtype)
    return jax.nn.silu(mamba2.causal_conv(x, weight[:, 0, :].astype(x.dtype), None, history,
                                          runs))


def _prepared(q, k, v, g, beta):
    """float32, keys and queries per value head, normalised; q scaled."""
    group = v.shape[2] // q.shape[2]
    q, k = (jnp.repeat(l2norm(x.astype(jnp.float32)), group, axis=2) for x in (q, k))
    q = q * q.shape[-1] ** -0.5
    return q, k, v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32)


def recurrent(q, k, v, g, beta, state=None):
    """The gated delta rule token by token (module docstring). ``q``, ``k`` (B, T, Hk, Dk),
    ``v`` (B, T, H, Dv), ``g``, ``beta`` (B, T, H); ``state`` (B, H, Dk, Dv) or ``None`` (zeros).
    Returns ``(out (B, T, H, Dv) float32, final state)``."""
    q, k, v, g, beta = _prepared(q, k, v, g, beta)
    if state is None:
        state = jnp.zeros((*v.shape[:1], v.shape[2], q.shape[-1], v.shape[-1]), jnp.float32)

    def step(s, x):
        q_t, k_t, v_t, g_t, b_t = x  # (B, H, D), (B, H)
        s = s * jnp.exp(g_t)[..., None, None]
        delta = (v_t - jnp.einsum("bhkv,bhk->bhv", s, k_t)) * b_t[..., None]
        s = s + k_t[..., :, None] * delta[..., None, :]
        return s, jnp.einsum("bhkv,bhk->bhv", s, q_t)
    state, out = jax.lax.scan(step, state.astype(jnp.float32),
                              [jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta)])
    return jnp.moveaxis(out, 0, 1), state


def unit_lower_inverse(m):
    """The inverse of unit lower-triangular matrices ``m`` (..., n, n), n a power of two, by
    halves: ``[[A, 0], [C, D]]^-1 = [[A^-1, 0], [-D^-1 C A^-1, D^-1]]``, both halves inverted
    together: ``log2 n`` rounds of batched matmuls. (XLA's CPU triangular solve took 1.5 s for
    64 systems of 64: a thousand times a matmul of the same shapes.)"""
    n = m.shape[-1]
    if n == 1:
        return jnp.ones_like(m)
    h = n // 2
    a_inv, d_inv = unit_lower_inverse(jnp.stack([m[..., :h, :h], m[..., h:, h:]]))
    corner = -(d_inv @ m[..., h:, :h]) @ a_inv
    return jnp.concatenate([jnp.concatenate([a_inv, jnp.zeros_like(a_inv)], -1),
                            jnp.concatenate([corner, d_inv], -1)], -2)


def _documents(runs, pad: int, n: int, c: int):
    """Packed documents in chunks (``runs`` (B, T), ``layers.document_runs``; ``None``: one
    document): ``same`` (B, 1, N, C, C), two tokens of one document; ``carried`` (B, 1, N, C), a
    token of the document whose state enters the chunk; ``to_end``, one of the chunk's last
    document; ``kept`` (B, 1, N), whether the entering document reaches the chunk's end."""
    if runs is None:
        return True, True, True, True
    r = jnp.pad(runs, ((0, 0), (0, pad)), mode="edge").reshape(runs.shape[0], 1, n, c)
    entering = jnp.concatenate([r[..., :1, :1], r[..., :-1, -1:]], axis=2)  # (B, 1, N, 1)
    return (r[..., :, None] == r[..., None, :], r == entering, r == r[..., -1:],
            r[..., -1] == entering[..., 0])


def chunked(q, k, v, g, beta, chunk_size: int = 64, state=None, runs=None):
    """``recurrent``'s result, a chunk at a time (module docstring); ``chunk_size`` a power of
    two. ``runs`` (B, T): packed documents, each from a zero state (module docstring)."""
    if chunk_size & (chunk_size - 1):
        raise ValueError(f"delta_chunk_size={chunk_size}: use a power of two (64 by default).")
    q, k, v, g, beta = _prepared(q, k, v, g, beta)
    b, t, h, dv = v.shape
    c = chunk_size
    pad = -t % c  # zero-padded tokens write nothing and decay nothing
    n = (t + pad) // c
    to_chunks = lambda x: jnp.moveaxis(  # noqa: E731  (B, T, H, ...) -> (B, H, N, C, ...)
        jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)).reshape(
            b, n, c, h, *x.shape[3:]), 3, 1)
    q, k, v, g, beta = (to_chunks(x) for x in (q, k, v, g, beta))
    cum = jnp.cumsum(g, axis=-1)  # G (B, H, N, C)
    same, carried, to_end, kept = _documents(runs, pad, n, c)
    lower = jnp.tril(jnp.ones((c, c), bool)) & same
    decay = jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    k_beta = k * beta[..., None]
    strict = jnp.where(jnp.eye(c, dtype=bool), 0.0, (k_beta @ jnp.swapaxes(k, -1, -2)) * decay)
    inverse = unit_lower_inverse(strict + jnp.eye(c))
    from_state = jnp.exp(cum) * carried  # (0 in a document that starts in the chunk)
    u, w = inverse @ (v * beta[..., None]), inverse @ (k_beta * from_state[..., None])
    attn = (q @ jnp.swapaxes(k, -1, -2)) * decay
    q_decayed = q * from_state[..., None]
    k_decayed = k * (jnp.exp(cum[..., -1:] - cum) * to_end)[..., None]
    last = (jnp.exp(cum[..., -1]) * kept)[..., None, None]
    if state is None:
        state = jnp.zeros((b, h, q.shape[-1], dv), jnp.float32)

    def step(s, x):
        u_i, w_i, q_i, k_i, a_i, last_i = x
        v_new = u_i - w_i @ s
        out = q_i @ s + a_i @ v_new
        return s * last_i + jnp.swapaxes(k_i, -1, -2) @ v_new, out
    per_chunk = [jnp.moveaxis(x, 2, 0) for x in (u, w, q_decayed, k_decayed, attn, last)]
    state, out = jax.lax.scan(step, state.astype(jnp.float32), per_chunk)
    out = jnp.moveaxis(out, 0, 2).reshape(b, h, n * c, dv)[:, :, :t]
    return jnp.swapaxes(out, 1, 2), state


class DepthwiseConv(nnx.Module):
    """The short convolution's weights, (channels, 1, width) as PyTorch's ``Conv1d`` stores them
    (``causal_conv`` applies them)."""

    def __init__(self, channels: int, width: int):
        self.weight = nnx.Param(jnp.zeros((channels, 1, width), jnp.float32))


class GatedRMSNorm(nnx.Module):
    """``rms_norm(x) * weight * silu(z)`` over the last axis (float32 inside)."""

    def __init__(self, dim: int, eps: float):
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x, z):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 ** 2, axis=-1, keepdims=True) + self.eps)
        normed = self.weight[...].astype(x.dtype) * x32.astype(x.dtype)
        return (normed * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)


def split_fused(cfg: DeltaNetConfig, qkvz, ba) -> dict:
    """Qwen3-Next's fused ``in_proj_qkvz`` and ``in_proj_ba`` weights (PyTorch's (out, in); per
    key head its q, k, then its group's v, z, and its group's b, a) as the split projections'."""
    nk, dk, r = cfg.n_key_heads, cfg.key_head_dim, cfg.n_value_heads // cfg.n_key_heads
    q, k, v, z = np.split(qkvz.reshape(nk, -1, qkvz.shape[-1]),
                          np.cumsum([dk, dk, r * cfg.value_head_dim]), axis=1)
    b, a = np.split(ba.reshape(nk, 2 * r, ba.shape[-1]), 2, axis=1)
    flat = lambda x: x.reshape(-1, x.shape[-1])  # noqa: E731
    return {"in_proj_qkv": np.concatenate([flat(q), flat(k), flat(v)]), "in_proj_z": flat(z),
            "in_proj_b": flat(b), "in_proj_a": flat(a)}


def fused(cfg: DeltaNetConfig, qkv, z, b, a) -> dict:
    """``split_fused`` undone: ``{"in_proj_qkvz": ..., "in_proj_ba": ...}``."""
    nk, width = cfg.n_key_heads, qkv.shape[-1]
    q, k, v = np.split(qkv, [cfg.key_dim, 2 * cfg.key_dim])
    per_head = lambda *xs: np.concatenate(  # noqa: E731
        [x.reshape(nk, -1, width) for x in xs], axis=1).reshape(-1, width)
    return {"in_proj_qkvz": per_head(q, k, v, z), "in_proj_ba": per_head(b, a)}


def init_state(cfg: DeltaNetConfig, batch: int, dtype=jnp.float32) -> dict:
    """An empty decoding state: the conv's last ``K - 1`` inputs and the delta rule's ``S``."""
    return {"conv": jnp.zeros((batch, cfg.conv_kernel - 1, 2 * cfg.key_dim + cfg.value_dim),
                              dtype),
            "state": jnp.zeros((batch, cfg.n_value_heads, cfg.key_head_dim, cfg.value_head_dim),
                               jnp.float32)}


class GatedDeltaNet(nnx.Module):
    """The layer's token mixer (``linear_attn`` in the checkpoint): module docstring."""

    def __init__(self, cfg: DeltaNetConfig, rngs: nnx.Rngs):
        linear = lambda i, o: nnx.Linear(i, o, use_bias=False, rngs=rngs)  # noqa: E731
        d, conv_dim = cfg.hidden_size, 2 * cfg.key_dim + cfg.value_dim
        self.in_proj_qkv, self.in_proj_z = linear(d, conv_dim), linear(d, cfg.value_dim)
        self.in_proj_b, self.in_proj_a = linear(d, cfg.n_value_heads), linear(d, cfg.n_value_heads)
        self.conv1d = DepthwiseConv(conv_dim, cfg.conv_kernel)
        self.A_log = nnx.Param(jnp.zeros((cfg.n_value_heads,), jnp.float32))
        self.dt_bias = nnx.Param(jnp.ones((cfg.n_value_heads,), jnp.float32))
        self.norm = GatedRMSNorm(cfg.value_head_dim, cfg.eps)
        self.out_proj = linear(cfg.value_dim, d)
        self.cfg = cfg

    def __call__(self, x, valid=None, cache: dict | None = None, runs=None, split=None):
        """``(out, new cache)`` for ``x`` (B, T, hidden); ``valid`` (B, T) marks real tokens
        (``None``: all); ``cache`` (``init_state``'s) continues a sequence, else it starts;
        ``runs`` (B, T): packed documents (``layers.document_runs``), each read as if alone;
        ``split``: the sequence split over devices (``recurrent_split``)."""
        cfg, (b, t, _) = self.cfg, x.shape
        if valid is not None:
            x = x * valid[..., None].astype(x.dtype)
        history = None if cache is None else cache["conv"]
        projected = self.in_proj_qkv(x)
        beta = jax.nn.sigmoid(self.in_proj_b(x).astype(jnp.float32))
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            self.in_proj_a(x).astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
        if valid is not None:  # padding keeps the state: no decay (g = 0), no write (beta = 0)
            g, beta = (jnp.where(valid[..., None], y, 0.0) for y in (g, beta))
        state = None if cache is None else cache["state"]
        if split is not None:
            mamba2.refuse_split_cache(cache)
            out = recurrent_split.run(split, projected, (g, beta), cfg.conv_kernel,
                                      self._conv, self._rule, self._transition, jnp.matmul)
        else:
            q, k, v = self._heads(causal_conv(projected, self.conv1d.weight[...], history, runs))
            if t == 1 and cache is not None:
                out, state = recurrent(q, k, v, g, beta, state)
            else:
                out, state = chunked(q, k, v, g, beta, cfg.chunk_size, state, runs)
        z = self.in_proj_z(x).reshape(b, t, cfg.n_value_heads, cfg.value_head_dim)
        out = self.norm(out.astype(x.dtype), z).reshape(b, t, cfg.value_dim)
        if cache is None:
            return self.out_proj(out), None
        conv = last_real_inputs(projected, history, cfg.conv_kernel - 1, valid)
        new_cache = {"conv": conv.astype(cache["conv"].dtype), "state": state}
        return self.out_proj(out), new_cache

    def _heads(self, mixed):
        """The convolution's output (B, T, C) as queries, keys and values per head."""
        cfg, (b, t, _) = self.cfg, mixed.shape
        q, k, v = jnp.split(mixed, [cfg.key_dim, 2 * cfg.key_dim], axis=-1)
        q, k = (y.reshape(b, t, cfg.n_key_heads, cfg.key_head_dim) for y in (q, k))
        return q, k, v.reshape(b, t, cfg.n_value_heads, cfg.value_head_dim)

    # the mixer's parts for ``recurrent_split.run`` (context parallelism)
    def _conv(self, x, runs):
        return causal_conv(x, self.conv1d.weight[...], None, runs)

    def _rule(self, mixed, gates, state, runs):
        return chunked(*self._heads(mixed), *gates, self.cfg.chunk_size, state, runs)

    def _transition(self, mixed, gates, runs):
        """The chunk's ``T``: what it does to an entering state (``Dk x Dk`` a head), the rule
        run on zero values from the identity."""
        q, k, v = self._heads(mixed)
        dk = k.shape[-1]
        eye = jnp.broadcast_to(jnp.eye(dk, dtype=jnp.float32), (*v.shape[:1], v.shape[2], dk, dk))
        return chunked(q, k, jnp.zeros((*v.shape[:3], dk), v.dtype), *gates,
                       self.cfg.chunk_size, eye, runs)[1]
