"""Quantised frozen weights for QLoRA: NF4, int8 and fp8 (e4m3) kernels, as pure jnp functions.

A kernel ``W`` [in, out] becomes a dict of arrays (its *parts*), ``codes`` among them:

- ``nf4`` (QLoRA, Dettmers et al. 2023): each output column is cut into blocks of 64 inputs;
  a block is divided by its absmax and each value replaced by the nearest of the 16 NF4
  values (``nf4_code_book``: quantiles of N(0, 1), normalised to [-1, 1], with an exact 0),
  stored as its 4-bit index, two per byte along the input axis (``codes`` uint8 [in/2, out]:
  row ``2i`` in the low nibble, ``2i + 1`` in the high one). The absmaxes ([in/64, out]) are
  quantised again (double quantisation): their mean is taken out (``absmax_offset``) and the
  rest stored as int8 (``absmax``) with one float32 scale per block of 256 along the output
  axis (``absmax_scale`` [in/64, out/256]; fewer than 256 where ``out`` does not divide:
  ``gcd(out, 256)``). bitsandbytes stores the same 8 bits with its dynamic (tree) 8-bit map;
  this uses a linear one, whose error bound is plain (absmax error <= block max / 254).
  About 4.13 bits a weight.
- ``int8``: per output channel, ``scale = absmax / 127`` and ``codes = round(W / scale)``:
  error <= absmax / 254.
- ``fp8``: per output channel, ``scale = absmax / 448`` (e4m3's largest finite value) and
  ``codes = (W / scale)`` cast to ``float8_e4m3fn`` (round to nearest, 3 mantissa bits):
  relative error <= 2^-4 on normal values.

Every part keeps ``W``'s two axes (the scalar offset aside), each a whole number of blocks of
``W``'s: a sharding spec written for ``W`` fits every part, so the codes and their scales split
together along the same mesh axis. ``dequantize`` gives ``W`` back, in any dtype, inside a step.

A stack of kernels [L, in, out] (a scanned decoder's layers, ``redco_zoo_models.layer_scan``; a
MoE block's experts, [E, in, out]; a scanned decoder's experts, [L, E, in, out]) is quantised
kernel by kernel: every part gets the leading axes in front (the offset one per kernel), so a
slice of each part on them is that kernel's parts, as if it had been quantised alone.
"""
from __future__ import annotations

import math
from statistics import NormalDist
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

FORMATS = ("nf4", "int8", "fp8")
BLOCK = 64  # NF4: inputs per absmax
SCALE_BLOCK = 256  # NF4: absmaxes per float32 scale (double quantisation)
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
Parts = dict[str, jax.Array]


def nf4_code_book() -> np.ndarray:
    """QLoRA's 16 NF4 values: 8 positive and 7 negative quantiles of N(0, 1) between 1/2 and
    ``offset`` = 0.9677083 (bitsandbytes' ``create_normal_map``), and 0, divided by the largest."""
    offset, quantile = 0.9677083, np.vectorize(NormalDist().inv_cdf)  # (scipy's ndtri: the same bits)
    positive = quantile(np.linspace(offset, 0.5, 9, dtype=np.float32)[:-1].astype(np.float64))
    negative = -quantile(np.linspace(offset, 0.5, 8, dtype=np.float32)[:-1].astype(np.float64))
    values = np.sort(np.concatenate([positive, [0.0], negative]))
    return (values / values.max()).astype(np.float32)


NF4 = nf4_code_book()


def _safe(scale: jax.Array) -> jax.Array:
    """``scale`` with zeros (an all-zero block or column) as 1: its codes are 0 either way."""
    return jnp.where(scale > 0, scale, 1.0)


def _check_shape(w: Any, fmt: str) -> None:
    if not 2 <= np.ndim(w) <= 4:
        raise ValueError(f"{fmt} quantises kernels [in, out] or stacks of them ([layers, in, "
                         f"out], [experts, in, out], [layers, experts, in, out]); got shape "
                         f"{np.shape(w)}.")
    if fmt == "nf4" and np.shape(w)[-2] % BLOCK:
        raise ValueError(f"nf4 needs a kernel's input dim to divide by {BLOCK} (its blocks); "
                         f"{np.shape(w)} does not: use --quantize_base int8 or fp8.")


def _per_layer(fn: Callable, n_stacked: int) -> Callable:
    """``fn`` mapped over ``n_stacked`` leading (layer) axes of its arguments and results."""
    for _ in range(n_stacked):
        fn = jax.vmap(fn)
    return fn


def quantize_nf4(w: jax.Array) -> Parts:
    """``W`` [in, out] as NF4 codes, two per byte, and double-quantised block absmaxes."""
    n_in, n_out = w.shape
    blocks = w.astype(jnp.float32).reshape(n_in // BLOCK, BLOCK, n_out)
    absmax = jnp.max(jnp.abs(blocks), axis=1)
    normalised = blocks / _safe(absmax)[:, None]
    nearest = sum((normalised > m).astype(jnp.uint8)  # (the midpoints below: one fused pass)
                  for m in (NF4[1:] + NF4[:-1]) / 2)
    pairs = nearest.reshape(n_in // 2, 2, n_out)
    offset = jnp.mean(absmax)
    centred = (absmax - offset).reshape(n_in // BLOCK, -1, math.gcd(n_out, SCALE_BLOCK))
    scale = jnp.max(jnp.abs(centred), axis=-1) / 127
    codes = jnp.round(centred / _safe(scale)[..., None]).astype(jnp.int8)
    return {"codes": pairs[:, 0] | (pairs[:, 1] << 4), "absmax": codes.reshape(absmax.shape),
            "absmax_scale": scale, "absmax_offset": offset}


def nf4_absmax(parts: Parts) -> jax.Array:
    """The block absmaxes [in/64, out] back from their 8-bit codes."""
    codes, scale = parts["absmax"], parts["absmax_scale"]
    grouped = codes.astype(jnp.float32).reshape(*scale.shape, -1) * scale[..., None]
    return grouped.reshape(codes.shape) + parts["absmax_offset"]


def dequantize_nf4(parts: Parts) -> jax.Array:
    """``W`` [in, out] (float32) from ``quantize_nf4``'s parts."""
    packed = parts["codes"]
    n_in, n_out = 2 * packed.shape[0], packed.shape[1]
    indices = jnp.stack([packed & 15, packed >> 4], axis=1).reshape(n_in // BLOCK, BLOCK, n_out)
    values = jnp.take(jnp.asarray(NF4), indices.astype(jnp.int32))
    return (values * nf4_absmax(parts)[:, None]).reshape(n_in, n_out)


def quantize_int8(w: jax.Array) -> Parts:
    """``W`` as int8 codes with one scale (absmax / 127) per output channel."""
    scale = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=0) / 127
    return {"codes": jnp.round(w / _safe(scale)).astype(jnp.int8), "scale": scale}


def quantize_fp8(w: jax.Array) -> Parts:
    """``W`` as float8 e4m3 codes with one scale (absmax / 448) per output channel."""
    scale = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=0) / FP8_MAX
    return {"codes": (w / _safe(scale)).astype(jnp.float8_e4m3fn), "scale": scale}


def dequantize_scaled(parts: Parts) -> jax.Array:
    """``W`` (float32) from int8 or fp8 codes and their per-channel scales."""
    return parts["codes"].astype(jnp.float32) * parts["scale"]


QUANTIZERS: dict[str, tuple[Callable[[jax.Array], Parts], Callable[[Parts], jax.Array]]] = {
    "nf4": (quantize_nf4, dequantize_nf4),
    "int8": (quantize_int8, dequantize_scaled),
    "fp8": (quantize_fp8, dequantize_scaled),
}


def check_format(fmt: str) -> None:
    if fmt not in QUANTIZERS:
        raise ValueError(f"--quantize_base {fmt!r}: choose one of {list(FORMATS)}.")


def quantize(w: Any, fmt: str) -> Parts:
    """``W`` [in, out] (or a stack: [L, in, out], [E, in, out], [L, E, in, out]) as ``fmt``'s
    parts (module docstring); abstract in, abstract out."""
    check_format(fmt)
    _check_shape(w, fmt)
    fn = _per_layer(QUANTIZERS[fmt][0], np.ndim(w) - 2)
    if isinstance(w, jax.ShapeDtypeStruct):
        return jax.eval_shape(fn, w)
    return jax.jit(fn)(jnp.asarray(w))


def dequantize(parts: Parts, fmt: str, dtype: Any = jnp.float32) -> jax.Array:
    """``W`` [in, out] (a stack's parts: its leading axes too) in ``dtype`` from ``fmt``'s parts
    (traceable: done inside the step)."""
    return _per_layer(QUANTIZERS[fmt][1], parts["codes"].ndim - 2)(parts).astype(dtype)


def part_spec(kernel_spec: P, ndim: int) -> P:
    """A part's spec from its kernel's (of a stack: the layer axis's entry dropped): 2-D parts
    as the kernel, a per-channel scale as its output dim, a scalar whole."""
    entries = (tuple(kernel_spec) + (None,) * (2 - len(kernel_spec)))[-2:]
    return P(*entries) if ndim == 2 else P(entries[1]) if ndim == 1 else P()
