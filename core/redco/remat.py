"""Rematerialisation: keep fewer activations in the forward pass, recompute them in the backward.

A train step keeps every layer's activations for the backward pass, at once: most of its memory
for long sequences. A layer wrapped with ``layer`` (the zoo's transformer blocks are) is
checkpointed by the policy in force when it is traced:

- ``"none"``: keep everything, recompute nothing (the default);
- ``"dots_saveable"``: keep matmul outputs, recompute the elementwise work (norms, activations,
  softmax) in the backward pass: a few percent more compute;
- ``"dots_with_no_batch_dims_saveable"``: keep only matmuls against weights, also recompute
  attention's batched ``q k^T`` and ``p v``;
- ``"full"``: keep only each layer's inputs and run the layer forward again in the backward
  pass (about a third more compute), the least memory.

``Trainer(remat=NAME)`` sets the policy while its steps are traced, so a model need not be
rebuilt to change it; ``with policy(NAME):`` does the same around any trace (an ahead-of-time
compile comparing policies, say). It is read at trace time: a function jitted under one policy
keeps it. A layer's recomputation is tied to the gradient arriving from the layer above, so no
compiler can schedule it early (XLA's CPU scheduler, seeing only ``jax.checkpoint``, recomputes
during the forward pass and saves nothing). Remat layers support reverse-mode autodiff only.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

POLICIES = {"none": None, "dots_saveable": jax.checkpoint_policies.dots_saveable,
            "dots_with_no_batch_dims_saveable":
                jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
            "full": jax.checkpoint_policies.nothing_saveable}

_current = contextvars.ContextVar("redco_remat_policy", default="none")


def check(name: str) -> str:
    """``name`` if it is a policy, else a ``ValueError`` naming the valid ones."""
    if name not in POLICIES:
        raise ValueError(f"Unknown remat policy {name!r}: use one of {sorted(POLICIES)}.")
    return name


def current() -> str:
    """The policy that layers traced now follow."""
    return _current.get()


@contextlib.contextmanager
def policy(name: str | None) -> Iterator[None]:
    """Layers traced inside follow policy ``name``; ``None`` keeps the policy in force."""
    token = None if name is None else _current.set(check(name))
    try:
        yield
    finally:
        if token is not None:
            _current.reset(token)


def layer(fn: Callable) -> Callable:
    """``fn(weights, *inputs)``, e.g. a Flax NNX module's ``__call__``, rematerialised by the
    policy in force when it is called. Arrays anywhere in the arguments are differentiated
    inputs (close over none); other leaves (ints, None) stay static."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if current() == "none":
            return fn(*args, **kwargs)
        leaves, tree = jax.tree.flatten((args, kwargs))
        traced = [isinstance(x, (jax.Array, np.ndarray)) for x in leaves]
        n_weights = sum(traced[:len(jax.tree.leaves(args[:1]))])

        def inner(*arrays):
            it = iter(arrays)
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
