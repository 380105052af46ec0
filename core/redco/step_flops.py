"""The FLOPs of one traced step, as MFU needs them.

XLA's cost analysis of the lowered step counts every dot and elementwise op, but a kernel
reached through a custom call counts as nothing. cuDNN's fused (flash) attention, which
``jax.nn.dot_product_attention(implementation="cudnn")`` and the zoo's models use on GPUs in
16-bit, is such a call: left out, a 1.1B LLaMA at 2048 tokens would miss ~15% of its FLOPs and
its MFU would read ~15% low. So the fused attention calls are found in the step's jaxpr (their
shapes are the global ones, before any sharding) and counted as XLA counts the same attention
unfused: ``Q K^T`` and ``P V`` forward, ``2·B·N·T·S·(D_qk + D_v)``, and twice that backward (dQ,
dK, dV and dP), the whole ``T x S`` square whatever the mask. That is also the convention of
model-FLOPs MFU (PaLM's appendix B), so a step logs the same MFU with or without the fused kernel.
"""
from __future__ import annotations

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, jaxprs_in_params

# jax's cuDNN attention primitives (jax/_src/cudnn/fused_attention_stablehlo.py) -> backward?
FUSED_ATTENTION = {"dot_product_attention_fwd_wrapper": False,
                   "dot_product_attention_bwd_wrapper": True}
BNTH = 1  # the primitives' ``layout`` param: 0 is (B, T, N, D), 1 is (B, N, T, D)


def step_flops(traced: jax.stages.Traced) -> float | None:
    """XLA's FLOP count of ``traced`` lowered, plus its fused attention; None where the backend
    gives no count."""
    flops = (traced.lower().cost_analysis() or {}).get("flops")
    if flops is None:
        return None
    return max(flops, 0.0) + fused_attention_flops(traced.jaxpr)


def fused_attention_flops(jaxpr: Jaxpr | ClosedJaxpr) -> float:
    """The FLOPs of the fused attention calls in ``jaxpr`` and every jaxpr inside it (a scan's
    body times its length, a cond's largest branch)."""
    jaxpr = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    total = 0.0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in FUSED_ATTENTION:
            total += attention_call_flops(eqn, FUSED_ATTENTION[eqn.primitive.name])
            continue
        inner = [fused_attention_flops(sub) for sub in jaxprs_in_params(eqn.params)]
        if eqn.primitive.name == "cond":
            total += max(inner, default=0.0)
        elif eqn.primitive.name == "scan":
            total += sum(inner) * eqn.params["length"]
        else:
            total += sum(inner)
    return total


def attention_call_flops(eqn, backward: bool) -> float:
    """``2·B·N·T·S·(D_qk + D_v)`` for one forward call, twice that for a backward one."""
    query, _, value = (v.aval.shape for v in eqn.invars[:3])
    if eqn.params.get("layout") == BNTH:
        (b, n, t, d_qk), s, d_v = query, value[2], value[3]
    else:
        (b, t, n, d_qk), s, d_v = query, value[1], value[3]
    forward = 2.0 * b * n * t * s * (d_qk + d_v)
    return 2 * forward if backward else forward
