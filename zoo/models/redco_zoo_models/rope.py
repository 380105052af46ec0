"""Rotary position embeddings (RoPE) as a HuggingFace ``config.json`` describes them.

A head's first ``rotary_dim`` features (all of them, or a ``partial_rotary_factor`` of them:
Phi-4-mini) are paired, half with half, and each pair is turned by ``position * inv_freq[i]``.
``inv_freq[i] = theta ** (-2i / rotary_dim)``, and the scaled variants change those frequencies
(and some scale ``cos``/``sin`` by an ``attention_factor``):

* ``linear``: every frequency divided by ``factor``;
* ``dynamic`` (NTK): ``theta`` grown with the call's length past ``max_position_embeddings``;
* ``llama3`` (Llama 3.1-3.3): long wavelengths divided by ``factor``, short ones kept, a smooth
  ramp between (``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``);
* ``yarn``: interpolated and extrapolated frequencies blended by a ramp over the dimensions
  (``beta_fast``, ``beta_slow``), ``cos``/``sin`` scaled by ``attention_factor`` (or ``mscale``);
* ``longrope`` (Phi-3.5, Phi-4): per-dimension ``short_factor`` while the call's length is within
  ``original_max_position_embeddings``, ``long_factor`` past it, ``cos``/``sin`` scaled;
* ``proportional`` (Gemma 4's global layers): the whole head is paired half with half, but only
  the first ``partial_rotary_factor * head_dim / 2`` pairs turn, at ``theta ** (-2i / head_dim)``
  (divided by ``factor``); the other pairs' frequency is 0 (they stay as they are).

M-RoPE (Qwen2.5-VL, Qwen3-VL: ``mrope_section``) turns each pair by one of three positions,
(temporal, height, width), ``positions`` (3, B, T): the pairs in ``mrope_section``'s three
consecutive runs (Qwen2.5-VL), or, ``mrope_interleaved`` (Qwen3-VL), pair ``i`` by axis
``i mod 3`` while that axis has pairs left (``3 * section``) and by the temporal axis past
them. Text alone gives the three axes equal positions: plain RoPE.

``dynamic`` and ``longrope`` depend on the length, taken as a call's largest position + 1, as
transformers does per forward pass. Every value comes from the config: nothing is assumed per
model (Llama 3.2 ships ``factor`` 32, 3.1 ``factor`` 8). A type or key this module does not know
is refused, naming it.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

KEYS = {  # each type's keys beyond rope_type, rope_theta and partial_rotary_factor
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "truncate"},
    "longrope": {"short_factor", "long_factor", "factor", "original_max_position_embeddings",
                 "attention_factor"},
    "proportional": {"factor", "partial_rotary_factor"},
}


@dataclasses.dataclass(frozen=True)
class Rope:
    """One attention's RoPE: its type and parameters, as read from the config."""
    rotary_dim: int
    theta: float = 10000.0
    kind: str = "default"
    max_position_embeddings: int = 4096
    params: tuple = ()  # the type's own keys, (key, value) pairs, sorted (hashable)
    mrope_section: tuple = ()  # M-RoPE: pairs per (temporal, height, width) axis
    mrope_interleaved: bool = False

    def get(self, key: str, default=None):
        return dict(self.params).get(key, default)

    def to_hf(self) -> dict:
        out = {"rope_type": self.kind, "rope_theta": self.theta}
        for key, value in self.params:
            out[key] = list(value) if isinstance(value, tuple) else value
        if self.mrope_section:
            out["mrope_section"] = list(self.mrope_section)
        if self.mrope_interleaved:
            out["mrope_interleaved"] = True
        return out


def read_rope(params: dict, head_dim: int, max_position_embeddings: int,
              where: str = "config.json", original_max: int | None = None) -> Rope:
    """A ``Rope`` from one ``rope_parameters`` (transformers 5) or ``rope_scaling`` dict with
    ``rope_theta`` merged in; ``partial_rotary_factor`` gives the rotary share of ``head_dim``."""
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    kind = {"su": "longrope", "mrope": "default"}.get(kind, kind)
    if kind not in KEYS:
        raise ValueError(f"{where}: RoPE type {kind!r} is not one the zoo reads "
                         f"({', '.join(KEYS)}).")
    known = KEYS[kind] | {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    if unknown := sorted(set(params) - known):
        raise ValueError(f"{where}: RoPE type {kind!r} has keys {unknown} the zoo does not read; "
                         f"it reads {sorted(known)}.")
    own = {k: tuple(v) if isinstance(v, list) else v for k, v in params.items()
           if k in KEYS[kind] and v is not None}
    if kind in ("llama3", "yarn", "longrope"):
        own["original_max_position_embeddings"] = (original_max or own.get(
            "original_max_position_embeddings") or max_position_embeddings)
    needed = {"linear": {"factor"}, "dynamic": {"factor"}, "llama3": KEYS["llama3"],
              "longrope": {"short_factor", "long_factor"}, "yarn": {"factor"}}.get(kind, set())
    if missing := sorted(needed - set(own)):
        raise ValueError(f"{where}: RoPE type {kind!r} needs {missing}.")
    rotary_dim = head_dim if kind == "proportional" else \
        int(head_dim * (params.get("partial_rotary_factor") or 1.0))
    for key in ("short_factor", "long_factor"):
        if key in own and len(own[key]) != rotary_dim // 2:
            raise ValueError(f"{where}: longrope's {key} has {len(own[key])} values; a rotary "
                             f"dimension of {rotary_dim} needs {rotary_dim // 2}.")
    return Rope(rotary_dim, float(params.get("rope_theta") or 10000.0), kind,
                max_position_embeddings, tuple(sorted(own.items())))


def _base_inv_freq(rope: Rope, theta=None):
    dim = rope.rotary_dim
    theta = rope.theta if theta is None else theta
    return 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))


def _llama3(rope: Rope):
    inv_freq = _base_inv_freq(rope)
    factor, low, high = rope.get("factor"), rope.get("low_freq_factor"), rope.get("high_freq_factor")
    old = rope.get("original_max_position_embeddings")
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return jnp.where(medium, smoothed, scaled), 1.0


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched by ``factor``."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(rope: Rope):
    dim, base = rope.rotary_dim, rope.theta
    factor, old = rope.get("factor"), rope.get("original_max_position_embeddings")
    mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
    attention = rope.get("attention_factor")
    if attention is None:
        attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) \
            if mscale and mscale_all else yarn_mscale(factor)
    correction = lambda rotations: (dim * math.log(old / (rotations * 2 * math.pi))  # noqa: E731
                                    / (2 * math.log(base)))
    low, high = correction(rope.get("beta_fast") or 32), correction(rope.get("beta_slow") or 1)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) /
                    ((high + 0.001 if low == high else high) - low), 0, 1)
    extrapolate = 1 - ramp
    pos_freqs = base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    inv_freq = (1 / (factor * pos_freqs)) * (1 - extrapolate) + (1 / pos_freqs) * extrapolate
    return inv_freq, attention


def _longrope(rope: Rope, seq_len):
    old = rope.get("original_max_position_embeddings")
    factor = rope.get("factor") or rope.max_position_embeddings / old
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old))
    ext = jnp.where(jnp.asarray(seq_len)[..., None] > old,
                    jnp.asarray(rope.get("long_factor"), jnp.float32),
                    jnp.asarray(rope.get("short_factor"), jnp.float32))
    shape = jnp.arange(0, rope.rotary_dim, 2, dtype=jnp.float32) / rope.rotary_dim
    return 1.0 / (ext * rope.theta ** shape), attention


def _dynamic(rope: Rope, seq_len):
    dim, longest = rope.rotary_dim, rope.max_position_embeddings
    factor = rope.get("factor")
    seq_len = jnp.maximum(seq_len, longest).astype(jnp.float32)[..., None]
    theta = rope.theta * ((factor * seq_len / longest) - (factor - 1)) ** (dim / (dim - 2))
    return _base_inv_freq(rope, theta), 1.0


def frequencies(rope: Rope, seq_len=None):
    """``(inv_freq (..., rotary_dim / 2), attention_factor)`` of ``rope`` for a call whose
    longest sequence is ``seq_len`` (traced, a scalar or one length per token; only ``dynamic``
    and ``longrope`` read it)."""
    if rope.kind == "linear":
        return _base_inv_freq(rope) / rope.get("factor"), 1.0
    if rope.kind == "llama3":
        return _llama3(rope)
    if rope.kind == "yarn":
        return _yarn(rope)
    if rope.kind == "longrope":
        return _longrope(rope, seq_len)
    if rope.kind == "dynamic":
        return _dynamic(rope, seq_len)
    if rope.kind == "proportional":
        return _proportional(rope), 1.0
    return _base_inv_freq(rope), 1.0


def _proportional(rope: Rope):
    """Gemma 4's: the first ``partial_rotary_factor`` of the head's pairs turn (module
    docstring), the rest at frequency 0."""
    half = rope.rotary_dim // 2
    turning = int((rope.get("partial_rotary_factor") or 1.0) * rope.rotary_dim // 2)
    inv_freq = jnp.where(jnp.arange(half) < turning, _base_inv_freq(rope), 0.0)
    return inv_freq / (rope.get("factor") or 1.0)


def depends_on_length(rope: Rope) -> bool:
    """Whether the frequencies change with the call's length (``dynamic``, ``longrope``)."""
    return rope.kind in ("dynamic", "longrope")


def apply_rope(x, positions, rope: Rope, seq_len=None):
    """``x`` (B, T, heads, D) with its first ``rope.rotary_dim`` features rotated, half with
    half, by ``positions`` (B, T), or M-RoPE's (3, B, T); ``seq_len`` as for ``frequencies``
    (default: the largest position + 1, over the batch as transformers takes it; packed rows
    give each token its document's length, ``segment_lengths``)."""
    if seq_len is None and depends_on_length(rope):
        seq_len = jnp.max(positions) + 1
    inv_freq, attention = frequencies(rope, seq_len)
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # (B, T, rotary_dim / 2)
    if positions.ndim == 3:
        angles = mrope_angles(angles, rope)
    return rotate(x, angles, attention)


def mrope_axes(section, interleaved: bool) -> np.ndarray:
    """Which of M-RoPE's (temporal, height, width) positions turns each pair (module docstring)."""
    if not interleaved:
        return np.repeat(np.arange(3), section)
    i = np.arange(sum(section))
    return np.where((i % 3 == 1) & (i < 3 * section[1]), 1,
                    np.where((i % 3 == 2) & (i < 3 * section[2]), 2, 0))


def mrope_angles(angles, rope: Rope):
    """(B, T, pairs) angles from each axis's (3, B, T, pairs), each pair its axis's."""
    if sum(rope.mrope_section) != rope.rotary_dim // 2:
        raise ValueError(f"(3, B, T) positions need M-RoPE's mrope_section, summing to the "
                         f"{rope.rotary_dim // 2} rotary pairs; this RoPE has "
                         f"{list(rope.mrope_section)}.")
    axis = mrope_axes(rope.mrope_section, rope.mrope_interleaved)
    return jnp.take_along_axis(angles, jnp.asarray(axis)[None, None, None, :], 0)[0]


def rotate(x, angles, attention=1.0):
    """``x`` (B, T, heads, D) with its first ``2 * pairs`` features turned, half with half, by
    ``angles`` (B, T, pairs), ``cos``/``sin`` scaled by ``attention``."""
    cos = (jnp.cos(angles) * attention)[:, :, None, :]
    sin = (jnp.sin(angles) * attention)[:, :, None, :]
    half = angles.shape[-1]
    dim = 2 * half
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:dim].astype(jnp.float32)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)
    return rotated if dim == x.shape[-1] else jnp.concatenate([rotated, x[..., dim:]], -1)


def pairs_as_halves(x):
    """``x`` (..., D) with features paired (0, 1), (2, 3), ... (DeepSeek's and Llama 4's
    complex-pair RoPE) laid out as halves (evens, then odds), which ``apply_rope`` turns alike.
    Queries and keys permuted alike keep every score ``q . k``."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], -1)


def segment_lengths(segment_ids):
    """(B, T): the length of each token's document in packed rows (a run of equal ids)."""
    b, n = segment_ids.shape
    index = jnp.broadcast_to(jnp.arange(n), (b, n))
    last = jnp.concatenate([segment_ids[:, 1:] != segment_ids[:, :-1], jnp.ones((b, 1), bool)], 1)
    first = jnp.concatenate([jnp.ones((b, 1), bool), last[:, :-1]], 1)
    end = jax.lax.cummin(jnp.where(last, index, n), axis=1, reverse=True)
    start = jax.lax.cummax(jnp.where(first, index, 0), axis=1)
    return end - start + 1
