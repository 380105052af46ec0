"""The LoRA projection's matmul, ``x @ W + (x @ A) @ B``, with a backward pass of its own: it
keeps only ``x`` of the activations, makes no gradient for the frozen kernel, and where a step
has more tokens than the kernel has rows it multiplies by ``W + A @ B``, made afresh in the
forward and the backward pass, rather than summing two full-size products (XLA fuses such a sum
into its users and keeps both products instead). ``LoRALinear`` calls ``adapted_matmul``.
``QuantizedLinear`` (QLoRA) calls ``adapted_quantized_matmul``, whose backward pass keeps the
codes and scales, not the dequantised ``W``, and dequantises again: a kept ``W`` would be a
full-precision copy of every frozen projection alive from the forward to the backward pass
(on a 2-layer model, 18.4 of its 25.5 MiB peak: more than the unquantised LoRA step's)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from redco import remat


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _adapted(x, kernel, a, b, precision):
    """``x @ W + (x @ A) @ B`` (``B`` already scaled). Differentiated, its backward pass keeps
    only ``x`` (and the params) and forms ``W``'s gradient only if it is used; where there are
    more tokens than the kernel has rows, it multiplies by ``W + A @ B`` (one full-size
    product, not two whose sum XLA may never store, keeping both instead)."""
    dot = functools.partial(jnp.dot, precision=precision)
    return dot(x, kernel) + dot(dot(x, a), b).astype(x.dtype)


def _merge_pays(tokens: jax.Array, kernel: jax.Array) -> bool:
    """Whether ``W + A @ B`` [in, out] is smaller than a product [tokens, out] it saves."""
    return tokens.size // tokens.shape[-1] >= kernel.shape[0]


def _merged(kernel, a, b, tie, precision):
    """``W + A @ B``; given a ``tie``, made from its first element too (times zero), so that XLA
    cannot share one merged kernel between two passes (the forward pass and the backward pass,
    or its recomputation), keeping a second copy of the adapted kernels alive all step long.
    Where ``tie`` is sharded, that element costs a scalar all-reduce."""
    if tie is not None:
        b = b + (tie[(0,) * tie.ndim] * 0).astype(b.dtype)
    return kernel + jnp.dot(a, b, precision=precision).astype(kernel.dtype)


def _adapted_fwd(x, kernel, a, b, precision):
    if not _merge_pays(x, kernel):
        return _adapted(x, kernel, a, b, precision), (x, kernel, a, b)
    tie = x if remat.current() == "full" else None  # "full" runs this again in the backward
    y = jnp.dot(x, _merged(kernel, a, b, tie, precision), precision=precision)
    return y, (x, kernel, a, b)


def _adapted_bwd(precision, saved, dy):
    x, kernel, a, b = saved
    rows = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731 - [..., n] -> [tokens, n]
    dot = functools.partial(jnp.dot, precision=precision)
    d_x_a = dot(dy, b.T)
    d_x = (dot(dy, _merged(kernel, a, b, dy, precision).T) if _merge_pays(dy, kernel.T)
           else dot(dy, kernel.T) + dot(d_x_a, a.T))
    d_a = dot(rows(x).T, rows(d_x_a))
    d_b = dot(rows(dot(x, a)).T, rows(dy))
    d_kernel = dot(rows(x).T, rows(dy))  # dead code (dropped by XLA) when the base is frozen
    return (d_x.astype(x.dtype), d_kernel.astype(kernel.dtype), d_a.astype(a.dtype),
            d_b.astype(b.dtype))


_adapted.defvjp(_adapted_fwd, _adapted_bwd)


def adapted_matmul(x: jax.Array, kernel: jax.Array, a: jax.Array, b: jax.Array,
                   precision) -> jax.Array:
    """``x @ W + (x @ A) @ B`` (``B`` already scaled) under the remat policy: the backward pass
    keeps ``x`` and, under a policy that keeps matmul outputs, the output
    (``redco.remat.matmul_output``)."""
    return remat.matmul_output(_adapted(x, kernel, a, b, precision))


def _tied(parts: dict, tie: jax.Array) -> dict:
    """``parts`` with ``tie``'s first element (times zero, cast) added to each, so that XLA
    dequantises only once ``tie`` (the layer's input, or its output's gradient) exists, not
    every layer's kernel at the step's start, nor one shared by the two passes."""
    zero = tie[(0,) * tie.ndim] * 0
    return {k: v + zero.astype(v.dtype) for k, v in parts.items()}


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _adapted_quantized(x, parts, a, b, dequantize, precision):
    """``_adapted`` with ``W = dequantize(parts)`` (frozen: no gradient for the parts)."""
    return _adapted(x, dequantize(parts), a, b, precision)


def _adapted_quantized_fwd(x, parts, a, b, dequantize, precision):
    y, _ = _adapted_fwd(x, dequantize(_tied(parts, x)), a, b, precision)
    return y, (x, parts, a, b)


def _adapted_quantized_bwd(dequantize, precision, saved, dy):
    x, parts, a, b = saved
    d_x, _, d_a, d_b = _adapted_bwd(precision, (x, dequantize(_tied(parts, dy)), a, b), dy)
    return d_x, jax.tree.map(lambda _: None, parts), d_a, d_b


_adapted_quantized.defvjp(_adapted_quantized_fwd, _adapted_quantized_bwd)


def adapted_quantized_matmul(x: jax.Array, parts: dict, dequantize, a: jax.Array, b: jax.Array,
                             precision) -> jax.Array:
    """``adapted_matmul`` with ``W = dequantize(parts)`` made inside the step, in the forward
    pass and again in the backward pass (module docstring): the backward keeps ``parts``."""
    return remat.matmul_output(_adapted_quantized(x, parts, a, b, dequantize, precision))
