"""Rematerialisation: keep fewer activations in the forward pass, recompute them in the backward.

A train step keeps every layer's activations for the backward pass, at once: most of its memory
for long sequences. A layer wrapped with ``layer`` (the zoo's transformer blocks are) is
checkpointed by the policy in force when it is traced:

- ``"none"``: keep everything, recompute nothing (the default). In a scanned stack of layers
  (``scanned_body``) it keeps what ``"dots_saveable"`` keeps: unrolled, XLA fuses the cheap
  residuals (a norm's, an activation's) into the backward pass that reads them, so they are
  recomputed, not kept; a loop's residuals cross its boundary, stacked over the layers, and
  cannot be fused away. Keeping them all there cost 1.9x the temp memory and 4-8% of a CPU
  step, and on an H200 1.66x the memory and 0.83x the speed, against dots_saveable's 0.83x
  of the memory (BENCHMARKS 33, 43, 48);
- ``"dots_saveable"``: keep matmul outputs, recompute the elementwise work (norms, activations,
  softmax) in the backward pass: a few percent more compute. A fused attention kernel's forward
  (cuDNN's flash attention on a GPU: ``FUSED_ATTENTION``) counts as matmuls: its output and
  softmax statistics are kept, so the backward pass does not run the kernel again;
- ``"dots_with_no_batch_dims_saveable"``: keep only matmuls against weights (and a fused
  attention kernel's outputs, and each attention's output, ``matmul_output``), also recompute
  attention's batched ``q k^T`` and ``p v``: attention's memory no longer quadratic in the
  sequence, and its backward recomputes the scores as a flash kernel's does;
- ``"full"``: keep only each layer's inputs and run the layer forward again in the backward
  pass (about a third more compute), the least memory.

``Trainer(remat=NAME)`` sets the policy while its steps are traced, so the model is not
rebuilt to change it; ``with policy(NAME):`` does the same around any trace (an ahead-of-time
compile comparing policies, say), and ``jax.jit`` keys its caches on it as on its own config.
A layer's recomputation is tied to the gradient arriving from above, so no compiler can run it
early (XLA's CPU scheduler, given a bare ``jax.checkpoint`` per layer, recomputes during the
forward pass and keeps almost all it would without remat: ``bench/remat_claims.py``). Remat
layers support reverse-mode autodiff only.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable, ContextManager

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from redco import _private, fsdp

MATMUL_OUTPUT = "redco_matmul_output"  # the name ``matmul_output`` gives a value
# JAX's primitives for a fused attention kernel's forward pass (``jax.nn.dot_product_attention``
# with ``implementation="cudnn"``): what they return is what the kernel's backward reads
FUSED_ATTENTION = frozenset({"dot_product_attention_fwd", "dot_product_attention_fwd_wrapper"})


def _or_matmul_outputs(saveable: Callable) -> Callable:
    """``saveable``, and also keep the values ``matmul_output`` names."""
    cp = jax.checkpoint_policies
    return cp.save_from_both_policies(saveable, cp.save_only_these_names(MATMUL_OUTPUT))


def _fused_attention_outputs(primitive, *_, **__) -> bool:
    """Keep what a fused attention kernel's forward returns (its output and statistics)."""
    return primitive.name in FUSED_ATTENTION


def _or_fused_attention(saveable: Callable) -> Callable:
    """``saveable``, and also keep a fused attention kernel's outputs and the named values."""
    return _or_matmul_outputs(jax.checkpoint_policies.save_from_both_policies(
        saveable, _fused_attention_outputs))


POLICIES = {"none": None,
            "dots_saveable": _or_fused_attention(jax.checkpoint_policies.dots_saveable),
            "dots_with_no_batch_dims_saveable":
                _or_fused_attention(jax.checkpoint_policies.dots_with_no_batch_dims_saveable),
            "full": jax.checkpoint_policies.nothing_saveable}

# A JAX config state, so that jax.jit keys its caches on the policy too (JAX's own
# ``jax_default_matmul_precision`` works the same way); REDCO_REMAT=NAME sets the default.
SCANNED_NONE = "dots_with_no_batch_dims_saveable"  # "none" inside a scanned body
_state = _private.enum_config_state("redco_remat", list(POLICIES), "none",
                                    "The rematerialisation policy of redco.remat.layer layers.")
_traced = {"layers": 0}  # remat layers traced so far (under a policy other than "none")


def check(name: str) -> str:
    """``name`` if it is a policy, else a ``ValueError`` naming the valid ones."""
    if name not in POLICIES:
        raise ValueError(f"Unknown remat policy {name!r}: use one of {sorted(POLICIES)}.")
    return name


def current() -> str:
    """The policy that layers traced now follow."""
    return _state.value


def policy(name: str | None) -> ContextManager:
    """Layers traced inside follow policy ``name``; ``None`` keeps the policy in force."""
    return contextlib.nullcontext() if name is None else _state(check(name))


def scanned_body() -> ContextManager:
    """Around the body of a scan over stacked layers (traced once for every layer it runs):
    ``"none"`` there means ``SCANNED_NONE`` (module docstring); other policies as given."""
    return policy(SCANNED_NONE) if current() == "none" else contextlib.nullcontext()


def matmul_output(x: jax.Array) -> jax.Array:
    """``x``, which the policies that keep matmul outputs keep as they keep one.

    For a projection computed from several matmuls, e.g. LoRA's ``x @ W + (x @ A) @ B``: compute
    it inside a ``jax.checkpoint`` that keeps none of its pieces and mark the result, so
    ``"dots_saveable"`` keeps the one full-size output instead of ``x @ W`` and ``(x @ A) @ B``
    both (``redco_zoo_models.lora.LoRALinear`` does)."""
    return checkpoint_name(x, MATMUL_OUTPUT)


def layers_traced() -> int:
    """How many ``layer`` calls have been traced under a policy other than ``"none"``."""
    return _traced["layers"]


def layer(fn: Callable) -> Callable:
    """``fn(weights, *inputs)``, e.g. a Flax NNX module's ``__call__``, rematerialised by the
    policy in force when it is called. Arrays anywhere in the arguments are differentiated
    inputs (close over none); other leaves (ints, None) stay static. Under FSDP the weights
    declared by ``redco.fsdp.gathering`` are gathered here: inside the checkpoint, so the
    backward pass gathers them again, under every policy but ``"none"``, which keeps them."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        leaves, tree = jax.tree.flatten((args, kwargs))
        gathers, n_first = fsdp.targets(leaves), len(jax.tree.leaves(args[:1]))
        if current() == "none":  # FSDP weights gathered here are kept for the backward pass
            a, k = jax.tree.unflatten(tree, fsdp.gather(leaves, gathers, leaves[n_first:]))
            return fn(*a, **k)
        _traced["layers"] += 1
        traced = [isinstance(x, (jax.Array, np.ndarray)) for x in leaves]
        # gathered weights are recomputed from their shards: tie those to the gradient as well
        n_traced_first = sum(traced[:n_first])
        n_weights = 0 if any(gathers) else n_traced_first
        gathers = [g for g, t in zip(gathers, traced) if t]

        def inner(*arrays):
            it = iter(fsdp.gather(arrays, gathers, arrays[n_traced_first:]))
            a, k = jax.tree.unflatten(tree, [next(it) if t else x for x, t in zip(leaves, traced)])
            return fn(*a, **k)
        arrays = [x for x, t in zip(leaves, traced) if t]
        return _tied_checkpoint(inner, POLICIES[current()], n_weights)(*arrays)
    return wrapped


def _tied_checkpoint(fn: Callable, saveable: Callable, n_weights: int) -> Callable:
    """``jax.checkpoint(fn, policy=saveable)`` whose saved values (but the first ``n_weights``
    inputs) get ``0 * gradient`` added before the recomputation: it cannot start earlier."""
    tie = []

    def fwd(*arrays):
        out, vjp = jax.vjp(jax.checkpoint(fn, policy=saveable), *arrays)
        tie[:] = [jnp.issubdtype(r.dtype, jnp.floating) and not any(r is w for w in arrays[:n_weights])
                  for r in jax.tree.leaves(vjp)]
        return out, vjp

    def bwd(vjp, grads):
        zero = next((g.ravel()[0] * 0 for g in jax.tree.leaves(grads)
                     if jnp.issubdtype(g.dtype, jnp.floating)), jnp.zeros(()))
        saved, tree = jax.tree.flatten(vjp)
        saved = [r + zero.astype(r.dtype) if t else r for r, t in zip(saved, tie)]
        return jax.tree.unflatten(tree, saved)(grads)

    run = jax.custom_vjp(fn)
    run.defvjp(fwd, bwd)
    return run
