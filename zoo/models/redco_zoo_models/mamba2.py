"""Mamba2, the state-space token mixer of the hybrid decoders (Granite 4 hybrid), as
transformers' ``torch_forward`` paths compute it.

**The layer** (``Mamba2``), for ``x`` (B, T, hidden):

1. ``in_proj`` gives, per token, ``z`` (the gate, d_inner), ``xBC`` (d_inner + 2 G N) and
   ``dt`` (H): d_inner = ``expand * hidden`` is H heads of P channels; ``B`` and ``C`` are G
   groups of an N-dim state each, a group shared by H / G heads.
2. ``xBC`` goes through a short causal depthwise convolution (width K, each channel its own K
   weights and a bias, a token seeing itself and the K - 1 before it) and the activation, then
   splits into ``x`` (H, P), ``B`` and ``C`` (G, N).
3. The selective scan, per head ``h``: ``dt = clip(softplus(dt + dt_bias))``,
   ``A = -exp(A_log)`` (a negative scalar per head), and a state S (P, N) per head::

       S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T        y_t = S_t C_t + D x_t

   ``recurrent_scan`` runs exactly this, token by token (the cross-check, and the one step a
   decoding token takes). ``chunked_scan`` (training, prompts) computes the same in chunks of
   L tokens (state-space duality, "SSD"): within a chunk the output is a masked quadratic form,
   ``y_l = sum_{s <= l} exp(a_l - a_s) (C_l . B_s) dt_s x_s`` with ``a`` the running sum of
   ``dt A`` over the chunk, an attention-like (L, L) product per head; each chunk also reduces
   its tokens to the state it leaves, ``sum_s exp(a_L - a_s) dt_s x_s B_s^T``, and a
   ``jax.lax.scan`` over the chunks carries the state from one chunk to the next (decayed by
   ``exp(a_L)``), each chunk adding ``exp(a_l) S_start C_l`` to its outputs. Work is
   T L per head rather than T^2, and the carried state is (P, N) per head, whatever T.
4. The gated RMSNorm: ``y * silu(z)``, normalised over each of the G groups of d_inner / G
   channels (not over all of d_inner), times a learned scale; then ``out_proj``.

Left padding (an ``attention_mask``), as transformers: the layer's input is zeroed at the
padding, and so is the convolution's output before the scan, so a padded prompt's real tokens
see zeros where the padding was (with no ``in_proj``/conv bias, what an unpadded prompt gives).
The scan runs in float32 (``dt``, the decays, the state), the projections in the params' dtype.

**Decoding** keeps a fixed-size state per sequence and layer (``init_cache``): the last K - 1
inputs of the convolution and the scan's state S. A prompt is read from the empty state (zeros:
what the uncached forward assumes) by the chunked scan, leaving both; each generated token then
takes one step of the recurrence from them. A padded token takes ``dt = 0``: it neither decays
nor writes the state, so a left-padded prompt's state is the unpadded prompt's (transformers'
too), and so is a right-padded one's (the serving engine's prefill), whose conv state keeps the
last real inputs (``layers.last_real_inputs``).

**Packed rows** (several documents in a row, ``segment_ids``): the convolution reads no other
document's inputs, and within a chunk the decay between two tokens of different documents is
zero (masked, as the causal mask masks later tokens); the state carried into a chunk reaches
only the tokens of the document it came from, and a chunk that ends in a new document passes on
that document's state alone. Each document computes what it computes alone.
"""
from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from redco_zoo_models import recurrent_split
from redco_zoo_models.layers import ACTIVATIONS, last_real_inputs


@dataclasses.dataclass(frozen=True)
class Mamba2Config:
    """One Mamba2 layer's shape (Granite's ``mamba_*`` config.json keys)."""
    hidden_size: int
    n_heads: int = 128
    head_dim: int = 0  # 0: expand * hidden_size // n_heads ("auto")
    n_groups: int = 1
    state_size: int = 256
    conv_kernel: int = 4
    expand: int = 2
    chunk_size: int = 256
    conv_bias: bool = True
    proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    activation: str = "silu"
    eps: float = 1e-6
    d_ssm: int = 0  # Falcon-H1: d_inner given (0: expand * hidden_size)
    out_proj_bias: bool | None = None  # Falcon-H1's projectors_bias (None: proj_bias)
    rms_norm: bool = True  # Falcon-H1: False for a plain gate, y * silu(z)
    norm_before_gate: bool = False  # Falcon-H1: rmsnorm(y) * silu(z)
    in_multiplier: float = 1.0  # Falcon-H1's ssm_in_multiplier: the input scaled
    multipliers: tuple[float, ...] = (1.0,) * 5  # ... ssm_multipliers: z, x, B, C, dt scaled
    time_step_init: tuple[float, ...] = ()  # Nemotron-H: dt's (min, max, floor) from scratch

    def __post_init__(self):
        inner = self.d_ssm or self.expand * self.hidden_size
        if not self.head_dim:
            object.__setattr__(self, "head_dim", inner // self.n_heads)
        if self.head_dim * self.n_heads != inner or self.n_heads % self.n_groups:
            raise ValueError(f"Mamba2: {self.n_heads} heads of {self.head_dim} channels in "
                             f"{self.n_groups} groups do not make d_inner (mamba_d_ssm or expand * "
                             f"hidden_size) = {inner}: fix mamba_n_heads, mamba_d_head or "
                             "mamba_n_groups.")

    @property
    def inner(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.n_groups * self.state_size


def causal_conv(x, weight, bias=None, history=None, runs=None):
    """Depthwise causal convolution of ``x`` (B, T, C) with ``weight`` (C, K): output ``t`` is
    ``sum_k weight[:, k] * x[t - K + 1 + k]``, plus ``bias``; before the start, ``history``
    (B, K - 1, C): the inputs before these (None: zeros). ``runs`` (B, T): packed documents
    (``layers.document_runs``), a token reading no other document's inputs."""
    k, t = weight.shape[1], x.shape[1]
    padded = jnp.pad(x, ((0, 0), (k - 1, 0), (0, 0))) if history is None else \
        jnp.concatenate([history, x], 1)
    taps = [padded[:, i:i + t] for i in range(k)]
    if runs is not None:
        earlier = jnp.pad(runs, ((0, 0), (k - 1, 0)), constant_values=-1)
        taps = [tap * (earlier[:, i:i + t] == runs)[..., None].astype(x.dtype)
                for i, tap in enumerate(taps)]
    out = sum(tap * weight[:, i] for i, tap in enumerate(taps))
    return out if bias is None else out + bias


def _heads(t, n_heads: int):
    """(B, T, G, N) -> (B, T, H, N): each group's B or C shared by its H / G heads."""
    return jnp.repeat(t, n_heads // t.shape[2], axis=2)


def recurrent_scan(x, dt, a, b, c, state=None):
    """The recurrence token by token. ``x`` (B, T, H, P), ``dt`` (B, T, H) (after softplus),
    ``a`` (H,) (negative), ``b``, ``c`` (B, T, G, N); ``state`` (B, H, P, N), zeros if None.
    Returns ``(y (B, T, H, P), final state)``, float32, without the ``D`` skip."""
    bsz, _, h, p = x.shape
    b, c = _heads(b, h), _heads(c, h)
    if state is None:
        state = jnp.zeros((bsz, h, p, b.shape[-1]), jnp.float32)

    def step(s, inputs):
        xt, dtt, bt, ct = inputs
        s = jnp.exp(dtt * a)[..., None, None] * s + (dtt[..., None] * xt)[..., None] * \
            bt[:, :, None, :]
        return s, jnp.einsum("bhpn,bhn->bhp", s, ct)
    time_first = [jnp.moveaxis(t.astype(jnp.float32), 1, 0) for t in (x, dt, b, c)]
    state, y = jax.lax.scan(step, state, time_first)
    return jnp.moveaxis(y, 0, 1), state


def chunked_scan(x, dt, a, b, c, state=None, chunk: int = 256, runs=None):
    """``recurrent_scan``'s outputs and final state, in chunks of ``chunk`` tokens (module
    docstring): quadratic within a chunk, the state carried across chunks by a scan. ``runs``
    (B, T): packed documents (``layers.document_runs``), each starting from a zero state: a token
    takes in only its own document's tokens and carried state."""
    bsz, t, h, p = x.shape
    pad = -t % chunk
    split = lambda v: jnp.moveaxis(jnp.pad(  # noqa: E731 (B, T, ...) -> (n, B, L, ...)
        v.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (v.ndim - 2)).reshape(
        bsz, -1, chunk, *v.shape[2:]), 1, 0)
    xs, dts, bs, cs = split(x), split(dt), split(_heads(b, h)), split(_heads(c, h))
    runs = jnp.zeros((bsz, t), jnp.int32) if runs is None else runs
    rs = jnp.moveaxis(jnp.pad(runs, ((0, 0), (0, pad)), mode="edge").reshape(bsz, -1, chunk),
                      1, 0)
    if state is None:
        state = jnp.zeros((bsz, h, p, bs.shape[-1]), jnp.float32)
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))

    def one_chunk(carry, inputs):
        s, run = carry  # the carried state, and the document it belongs to
        xc, dtc, bc, cc, rc = inputs  # (B, L, H, P), (B, L, H), (B, L, H, N) x 2, (B, L)
        cum = jnp.cumsum(dtc * a, axis=1)  # (B, L, H): log-decay from the chunk's start
        gap = cum[:, :, None, :] - cum[:, None, :, :]  # (B, l, s, H): a_l - a_s
        seen = causal[None] & (rc[:, :, None] == rc[:, None, :])
        decay = jnp.exp(jnp.where(seen[..., None], gap, -jnp.inf))
        scores = jnp.einsum("blhn,bshn->blsh", cc, bc) * decay
        dx = xc * dtc[..., None]
        y = jnp.einsum("blsh,bshp->blhp", scores, dx)
        carried = jnp.exp(cum) * (rc == run[:, None])[..., None]  # 0 in a new document
        y = y + jnp.einsum("blhn,bhpn->blhp", cc, s) * carried[..., None]
        last = rc[:, -1]
        to_end = jnp.exp(cum[:, -1:, :] - cum) * (rc == last[:, None])[..., None]
        kept = jnp.exp(cum[:, -1, :]) * (last == run)[:, None]
        s = kept[..., None, None] * s + jnp.einsum("blhp,blhn->bhpn", dx * to_end[..., None], bc)
        return (s, last), y
    (state, _), y = jax.lax.scan(one_chunk, (state, runs[:, 0]), (xs, dts, bs, cs, rs))
    return jnp.moveaxis(y, 0, 1).reshape(bsz, -1, h, p)[:, :t], state


class GatedRMSNorm(nnx.Module):
    """``rmsnorm(y * silu(z))`` over each of ``groups`` equal groups of channels, times a
    learned scale, in float32; ``before_gate`` (Falcon-H1's ``mamba_norm_before_gate``):
    ``rmsnorm(y) * silu(z)``."""

    def __init__(self, dim: int, groups: int, eps: float, before_gate: bool = False):
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.groups, self.eps, self.before_gate = groups, eps, before_gate

    def __call__(self, y, z):
        gate = jax.nn.silu(z.astype(jnp.float32))
        h = y.astype(jnp.float32) * (1.0 if self.before_gate else gate)
        g = h.reshape(*h.shape[:-1], self.groups, -1)
        g = g * jax.lax.rsqrt(jnp.mean(g * g, axis=-1, keepdims=True) + self.eps)
        h = g.reshape(h.shape) * self.weight[...].astype(jnp.float32)
        return (h * (gate if self.before_gate else 1.0)).astype(y.dtype)


class Mamba2(nnx.Module):
    """The Mamba2 mixer, named as transformers names it (``in_proj``, ``conv1d``, ``dt_bias``,
    ``A_log``, ``D``, ``norm``, ``out_proj``); ``conv1d/weight`` is (channels, K)."""

    def __init__(self, cfg: Mamba2Config, rngs: nnx.Rngs):
        d, h = cfg.hidden_size, cfg.n_heads
        self.in_proj = nnx.Linear(d, cfg.inner + cfg.conv_dim + h, use_bias=cfg.proj_bias,
                                  rngs=rngs)
        self.conv1d = Conv(cfg.conv_dim, cfg.conv_kernel, cfg.conv_bias, rngs)
        self.dt_bias = nnx.Param(jnp.ones((h,), jnp.float32))
        self.A_log = nnx.Param(jnp.log(jnp.arange(1, h + 1, dtype=jnp.float32)))
        self.D = nnx.Param(jnp.ones((h,), jnp.float32))
        if cfg.rms_norm:
            self.norm = GatedRMSNorm(cfg.inner, cfg.n_groups, cfg.eps, cfg.norm_before_gate)
        out_bias = cfg.proj_bias if cfg.out_proj_bias is None else cfg.out_proj_bias
        self.out_proj = nnx.Linear(cfg.inner, d, use_bias=out_bias, rngs=rngs)
        self.cfg = cfg

    def __call__(self, x, valid=None, cache: dict | None = None, scan=None, runs=None,
                 split=None):
        """``(y, cache)``: ``x`` (B, T, hidden) -> ``y`` (B, T, hidden); ``valid`` (B, T): the
        real tokens (None: all); ``cache`` (``init_cache``): the state after the tokens before
        these, returned updated (None: none kept). ``scan``: ``chunked_scan`` (the default for
        more than one token) or ``recurrent_scan`` (the default for one). ``runs`` (B, T):
        packed documents (``layers.document_runs``), each read as if alone; ``split``: the
        sequence split over devices (``recurrent_split``)."""
        cfg, (bsz, t, _) = self.cfg, x.shape
        valid = jnp.ones((bsz, t), bool) if valid is None else valid
        z, xbc, dt = jnp.split(self._projected(_kept(x, valid)),
                               [cfg.inner, cfg.inner + cfg.conv_dim], -1)
        dt = jnp.clip(jax.nn.softplus(dt.astype(jnp.float32) + self.dt_bias[...]),
                      *cfg.time_step_limit)
        dt = _kept(dt, valid)  # a padded token: no decay, no write
        if split is not None:
            refuse_split_cache(cache)
            y = recurrent_split.run(split, xbc, (dt, valid), cfg.conv_kernel, self._conv,
                                    self._rule, self._transition, jnp.multiply)
            return self.out_proj(self._gated(y.astype(x.dtype), z)), None
        history = None if cache is None else cache["conv"].astype(xbc.dtype)
        new_conv = last_real_inputs(xbc, history, cfg.conv_kernel - 1, valid)
        xs, b, c = self._parts(_kept(self._conv(xbc, runs, history), valid))
        if scan is None:
            scan = recurrent_scan if t == 1 else partial(chunked_scan, chunk=cfg.chunk_size,
                                                         runs=runs)
        y, state = scan(xs, dt, self._a(), b, c, None if cache is None else cache["ssm"])
        y = y + self.D[...].astype(jnp.float32)[:, None] * xs.astype(jnp.float32)
        y = self._gated(y.reshape(bsz, t, cfg.inner).astype(x.dtype), z)
        new = None if cache is None else {"conv": new_conv.astype(cache["conv"].dtype),
                                          "ssm": state.astype(cache["ssm"].dtype)}
        return self.out_proj(y), new

    def _projected(self, x):
        """``in_proj`` of ``x``; Falcon-H1's multipliers: its input scaled, then each part of
        the projection (z, x, B, C, dt; transformers' ``mup_vector``)."""
        cfg = self.cfg
        if cfg.in_multiplier != 1.0:
            x = x * jnp.asarray(cfg.in_multiplier, x.dtype)
        out = self.in_proj(x)
        if cfg.multipliers == (1.0,) * 5:
            return out
        gs = cfg.n_groups * cfg.state_size
        sizes = (cfg.inner, cfg.inner, gs, gs, cfg.n_heads)
        scale = jnp.concatenate([jnp.full((n,), m, jnp.float32)
                                 for n, m in zip(sizes, cfg.multipliers)])
        return out * scale.astype(out.dtype)

    def _gated(self, y, z):
        """The scan's output gated by ``z``: the gated RMSNorm, or (Falcon-H1 without
        ``mamba_rms_norm``) ``y * silu(z)``."""
        if self.cfg.rms_norm:
            return self.norm(y, z)
        return (y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(y.dtype)

    def _a(self):
        return -jnp.exp(self.A_log[...].astype(jnp.float32))

    def _conv(self, xbc, runs, history=None):
        return ACTIVATIONS[self.cfg.activation](self.conv1d(xbc, history, runs))

    def _parts(self, xbc):
        """The convolution's output (B, T, C) as ``x`` per head and ``B``, ``C`` per group."""
        cfg, (bsz, t, _) = self.cfg, xbc.shape
        xs, b, c = jnp.split(xbc, [cfg.inner, cfg.inner + cfg.n_groups * cfg.state_size], -1)
        return (xs.reshape(bsz, t, cfg.n_heads, cfg.head_dim),
                *(v.reshape(bsz, t, cfg.n_groups, cfg.state_size) for v in (b, c)))

    # the mixer's parts for ``recurrent_split.run`` (context parallelism)
    def _rule(self, xbc, dt_valid, state, runs):
        """``(y (B, L, d_inner) with the D skip, final state)`` of a chunk from ``state``."""
        dt, valid = dt_valid
        xs, b, c = self._parts(_kept(xbc, valid))
        y, state = chunked_scan(xs, dt, self._a(), b, c, state, self.cfg.chunk_size, runs)
        y = y + self.D[...].astype(jnp.float32)[:, None] * xs.astype(jnp.float32)
        return y.reshape(*xbc.shape[:2], self.cfg.inner), state

    def _transition(self, xbc, dt_valid, runs):
        """The chunk's ``T``: its decay of an entering state (per head, broadcast), the scan
        run on zero inputs from a state of ones."""
        dt, valid = dt_valid
        xs, b, c = self._parts(_kept(xbc, valid))
        ones = jnp.ones((xs.shape[0], *xs.shape[2:], b.shape[-1]), jnp.float32)
        return chunked_scan(jnp.zeros_like(xs), dt, self._a(), b, c, ones,
                            self.cfg.chunk_size, runs)[1]


def _kept(v, valid):
    """``v`` (B, T, ...) zeroed at the padded tokens."""
    return v * valid.reshape(valid.shape + (1,) * (v.ndim - 2)).astype(v.dtype)


def refuse_split_cache(cache) -> None:
    """A prompt read into a cache with its sequence split: not for a recurrent layer yet."""
    if cache is not None:
        raise ValueError("Reading a prompt into a cache with its sequence split (context "
                         "parallelism) is not supported for a model with recurrent layers "
                         "(Gated DeltaNet, Mamba2): generate with n_context_shards=1.")


def init_cache(batch: int, cfg: Mamba2Config, dtype=jnp.float32) -> dict:
    """One Mamba2 layer's empty decoding state: the convolution's last K - 1 inputs
    (``conv``, B x (K - 1) x channels, in ``dtype``) and the scan's state (``ssm``,
    B x H x P x N, float32), a fixed size whatever the length."""
    return {"conv": jnp.zeros((batch, cfg.conv_kernel - 1, cfg.conv_dim), dtype),
            "ssm": jnp.zeros((batch, cfg.n_heads, cfg.head_dim, cfg.state_size), jnp.float32)}


class Conv(nnx.Module):
    """The depthwise causal convolution's params: ``weight`` (channels, K), ``bias``."""

    def __init__(self, channels: int, width: int, bias: bool, rngs: nnx.Rngs):
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (channels, width)) * 0.02)
        if bias:
            self.bias = nnx.Param(jnp.zeros((channels,), jnp.float32))

    def __call__(self, x, history=None, runs=None):
        bias = self.bias[...].astype(x.dtype) if hasattr(self, "bias") else None
        return causal_conv(x, self.weight[...].astype(x.dtype), bias, history, runs)


KEYS = {  # config.json key -> Mamba2Config field (Granite 4 hybrid's names)
    "mamba_n_heads": "n_heads", "mamba_d_head": "head_dim", "mamba_n_groups": "n_groups",
    "mamba_d_state": "state_size", "mamba_d_conv": "conv_kernel", "mamba_expand": "expand",
    "mamba_chunk_size": "chunk_size", "mamba_conv_bias": "conv_bias",
    "mamba_proj_bias": "proj_bias", "time_step_limit": "time_step_limit",
}


PARALLEL_KEYS = {  # Falcon-H1's own: config.json key -> (Mamba2Config field, its default)
    "mamba_d_ssm": ("d_ssm", None), "mamba_rms_norm": ("rms_norm", False),
    "mamba_norm_before_gate": ("norm_before_gate", True),
    "projectors_bias": ("out_proj_bias", False), "ssm_in_multiplier": ("in_multiplier", 1.0),
    "ssm_multipliers": ("multipliers", (1.0,) * 5),
}


def read_config(config: dict, parallel: bool = False) -> Mamba2Config:
    """The Mamba2 layers' shape from a hybrid's ``config.json`` (transformers' defaults for
    keys it omits; ``mamba_d_head`` ``"auto"``: what the heads leave); ``parallel``: Falcon-H1's
    (``PARALLEL_KEYS`` too)."""
    given = {field: config[key] for key, field in KEYS.items() if config.get(key) is not None}
    if given.get("head_dim") == "auto":
        del given["head_dim"]
    if "time_step_limit" in given:  # (transformers 5 writes infinity as {"__float__": ...})
        given["time_step_limit"] = tuple(float(v["__float__"] if isinstance(v, dict) else v)
                                         for v in given["time_step_limit"])
    if parallel:
        given.update({field: config[key] if config.get(key) is not None else default
                      for key, (field, default) in PARALLEL_KEYS.items()})
        given["d_ssm"] = given["d_ssm"] or 0
        given["multipliers"] = tuple(float(m) for m in given["multipliers"])
    return Mamba2Config(config["hidden_size"], activation=config.get("hidden_act", "silu"),
                        eps=config.get("rms_norm_eps", 1e-6), **given)


def write_config(cfg: Mamba2Config, parallel: bool = False) -> dict:
    """``read_config`` undone: the ``mamba_*`` keys (and ``PARALLEL_KEYS``)."""
    out = {key: getattr(cfg, field) for key, field in KEYS.items()}
    out["time_step_limit"] = [v if math.isfinite(v) else {"__float__": "Infinity" if v > 0 else "-Infinity"}
                              for v in cfg.time_step_limit]  # (as transformers 5 writes them)
    if parallel:
        out.update({key: getattr(cfg, field) for key, (field, _) in PARALLEL_KEYS.items()})
        out["mamba_d_ssm"], out["ssm_multipliers"] = cfg.inner, list(cfg.multipliers)
    return out


def token_mask(allowed, cache_index=0):
    """The real tokens (B, T) of a decoder layer's input, read off its mask
    (``attention.decoder_inputs``: a token, in slot ``cache_index + i``, sees its own slot
    exactly when it is real); ``None`` where the mask is plain causal (no padding)."""
    if allowed is None:
        return None
    b, _, t, _ = allowed.shape
    slots = jnp.broadcast_to(jnp.reshape(cache_index, (-1, 1)) + jnp.arange(t), (b, t))
    return jnp.take_along_axis(allowed[:, 0], slots[..., None], -1)[..., 0]
