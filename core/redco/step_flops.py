"""The FLOPs of one traced step, as MFU needs them, counted from its jaxpr.

Why not XLA's cost analysis of the lowered step: on GPUs jax does not offer it (the CUDA plugin
runs through PJRT's C API, where ``Lowered.cost_analysis()`` returns None; measured on an H100,
jax 0.11.2), and a compiled step's analysis is per device, after fusion and rewrites. So the step
is walked as traced (shapes are the global ones, before any sharding) and its matrix products are
counted, which is where the FLOPs of a network are:

* ``dot_general``: ``2 x`` the lhs size ``x`` the rhs's free dimensions, as XLA counts a dot;
* ``conv_general_dilated``: ``2 x`` the output size ``x`` one output feature's kernel size;
* cuDNN's fused (flash) attention, which ``jax.nn.dot_product_attention(implementation="cudnn")``
  and the zoo's models use on GPUs in 16-bit, counted as the same attention unfused: ``Q K^T``
  and ``P V`` forward, ``2·B·N·T·S·(D_qk + D_v)``, twice that backward (dQ, dK, dV, dP), the
  whole ``T x S`` square whatever the mask (as PaLM's appendix B counts model FLOPs).

A scan's body counts ``length`` times, a while loop's once (its trip count is not known when
tracing), a cond's largest branch. XLA's own analysis of a compiled step counts every loop's
body once, a scan's too: ``loop_repeats_flops`` is what that leaves out (a scanned layer stack's
other layers, gradient accumulation's other micro-batches), for a caller that reads XLA's count
(the layout planner). A product whose result
reaches no output is not counted (XLA drops it). Elementwise work (norms,
softmax, the optimizer's update) is left out: on a transformer it is under 1% (the tests hold
the count to XLA's own on a CPU, within 2%, remat and LoRA included).
"""
from __future__ import annotations

import math
from typing import Sequence

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, jaxprs_in_params

# the primitives of jax.nn.dot_product_attention(implementation="cudnn") -> backward? (renamed
# by a jax upgrade, tests/core/test_step_flops.py goes red)
FUSED_ATTENTION = {"dot_product_attention_fwd_wrapper": False,
                   "dot_product_attention_bwd_wrapper": True}
BNTH = 1  # the attention primitives' ``layout`` param: 0 is (B, T, N, D), 1 is (B, N, T, D)


def step_flops(traced: jax.stages.Traced) -> float:
    """The FLOPs of one run of ``traced`` (``jax.jit(f).trace(...)``), every device together."""
    return jaxpr_flops(traced.jaxpr)


def loop_repeats_flops(traced: jax.stages.Traced) -> float:
    """The FLOPs of every scan's body past its first trip, every device together: a scan of
    ``length`` trips counts its body's FLOPs ``length - 1`` more times than XLA's cost analysis
    of the compiled step does (nested scans multiply)."""
    return jaxpr_flops(traced.jaxpr) - jaxpr_flops(traced.jaxpr, scans_once=True)


def jaxpr_flops(jaxpr: Jaxpr | ClosedJaxpr, used: Sequence[bool] | None = None,
                scans_once: bool = False) -> float:
    """The FLOPs of ``jaxpr``'s products (and of every jaxpr inside it) that reach an output,
    all of them or those ``used`` marks: a product whose result is never used is dropped, as
    XLA drops it (a custom backward pass may form a frozen weight's gradient and discard it).
    ``scans_once``: a scan's body counted once, as XLA counts a loop's."""
    jaxpr = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    used = [True] * len(jaxpr.outvars) if used is None else used
    live = {v for v, u in zip(jaxpr.outvars, used) if u and not isinstance(v, Literal)}
    total = 0.0
    for eqn in reversed(jaxpr.eqns):
        used_outputs = [v in live for v in eqn.outvars]
        if not any(used_outputs) and not eqn.effects:
            continue
        total += eqn_flops(eqn, used_outputs, scans_once)
        live.update(v for v in eqn.invars if not isinstance(v, Literal))
    return total


def eqn_flops(eqn, used_outputs: list[bool], scans_once: bool = False) -> float:
    """One equation's FLOPs: a product's, or those of the jaxprs inside it."""
    name = eqn.primitive.name
    if name in COUNTERS:
        return COUNTERS[name](eqn)
    inner = [jaxpr_flops(sub, used_outputs if len(sub.outvars) == len(eqn.outvars)
                         and name not in ("scan", "while") else None, scans_once)
             for sub in jaxprs_in_params(eqn.params)]
    if name == "cond":
        return max(inner, default=0.0)
    if name == "scan" and not scans_once:
        return sum(inner) * eqn.params["length"]
    return sum(inner)


def dot_flops(eqn) -> float:
    lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
    (_, rhs_contracting), (_, rhs_batch) = eqn.params["dimension_numbers"]
    rhs_free = [n for i, n in enumerate(rhs) if i not in (*rhs_contracting, *rhs_batch)]
    return 2.0 * math.prod(lhs) * math.prod(rhs_free)


def conv_flops(eqn) -> float:
    kernel = eqn.invars[1].aval.shape
    out_features = kernel[eqn.params["dimension_numbers"].rhs_spec[0]]
    return 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(kernel) / out_features


def attention_flops(eqn) -> float:
    """``2·B·N·T·S·(D_qk + D_v)`` for one forward call, twice that for a backward one."""
    query, _, value = (v.aval.shape for v in eqn.invars[:3])
    if eqn.params.get("layout") == BNTH:
        (b, n, t, d_qk), s, d_v = query, value[2], value[3]
    else:
        (b, t, n, d_qk), s, d_v = query, value[1], value[3]
    forward = 2.0 * b * n * t * s * (d_qk + d_v)
    return 2 * forward if FUSED_ATTENTION[eqn.primitive.name] else forward


COUNTERS = {"dot_general": dot_flops, "conv_general_dilated": conv_flops,
            **{name: attention_flops for name in FUSED_ATTENTION}}
