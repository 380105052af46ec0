"""FSDP's per-layer gather: each layer all-gathers its own weights just before it runs, and again
in the backward pass, so no more than one layer's gathered weights are alive at a time.

Under the ``fsdp`` and ``auto+fsdp`` rules a weight is split over ``dp``, the axis the batch is
split over too (and over ``cp`` as well with context parallelism: ``dp`` x ``cp`` devices share
the weights out, as torchtitan's FSDP spans its context axis). Left to itself, XLA's SPMD
partitioner often multiplies such a weight by all-gathering the *activations* over the batch
instead: their size is the global batch's, so a device's peak then rises with the number of
devices (measured on the zoo LLaMA, width 1024, 8 layers, one 512-token row per device: temp
bytes 493, 599 and 985 MB on 2, 4 and 8 devices).
Constraining each layer's weights to be gathered before use fixes the choice. Under a remat
policy the gather runs inside the layer's checkpoint (``redco.remat.layer``), so the backward
pass gathers them again rather than keep them, as ZeRO-3 and PyTorch's FSDP do; with remat
``"none"`` the gathered weights are kept for the backward pass.

The ``Trainer`` (and the planner, measuring the same step) declares the params of a step:

    with fsdp.gathering(params, shardings):
        loss = loss_fn(params, batch)      # each remat.layer gathers the weights it is given

``remat.layer`` asks ``targets(leaves)`` which of its inputs are declared params and gathers
those (``gather``); a model with no ``remat.layer`` is laid out as XLA chooses.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import jax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

GATHERED = "redco_fsdp_gathered"  # the checkpoint name of a gathered weight
FSDP_AXES = ("dp", "cp")  # the axes weights are split over, where the mesh has them
_declared: list[dict[int, NamedSharding]] = []  # a stack: id(param leaf) -> its gathered sharding


def without_axes(spec: P, axes: tuple[str, ...] = FSDP_AXES) -> P:
    """``spec`` with ``axes`` taken out of every entry: the layout after gathering over them."""
    def drop(entry):
        if isinstance(entry, tuple):
            kept = tuple(a for a in entry if a not in axes)
            return kept if len(kept) > 1 else (kept[0] if kept else None)
        return None if entry in axes else entry
    return P(*(drop(entry) for entry in spec))


def gathered_shardings(shardings: Any) -> Any:
    """Per leaf of a params-shaped tree of ``NamedSharding``: the sharding gathered over the
    FSDP axes, or None where the leaf is not split over them (nothing to gather)."""
    def one(sharding):
        if not isinstance(sharding, NamedSharding) or not set(FSDP_AXES) & set(
                jax.tree.leaves(tuple(sharding.spec))):
            return None
        return NamedSharding(sharding.mesh, without_axes(sharding.spec))
    return jax.tree.map(one, shardings, is_leaf=lambda x: isinstance(x, NamedSharding))


@contextlib.contextmanager
def gathering(params: Any, shardings: Any) -> Iterator[None]:
    """While tracing inside, ``remat.layer`` gathers each leaf of ``params`` that its
    ``shardings`` (a tree like ``params`` of ``NamedSharding``) splits over ``dp`` (or
    ``cp``). ``shardings`` None declares nothing: a declaration around this one stays in force
    (the planner's, around a ``Trainer`` loss traced before its layout is known)."""
    if shardings is None:
        yield
        return
    gathered = jax.tree.leaves(gathered_shardings(shardings), is_leaf=lambda x: x is None)
    table = {id(leaf): target for leaf, target in zip(jax.tree.leaves(params), gathered)
             if target is not None}
    _declared.append(table)
    try:
        yield
    finally:
        _declared.pop()


def targets(leaves: Sequence[Any]) -> list[NamedSharding | None]:
    """For each of a layer's input leaves: the sharding to gather it to, None for the rest."""
    table = _declared[-1] if _declared else {}
    return [table.get(id(leaf)) for leaf in leaves]


def gather(values: Sequence[Any], shardings: Sequence[NamedSharding | None]) -> list[Any]:
    """``values`` with each one that has a sharding constrained to it and named ``GATHERED``
    (no remat policy saves it: under one, the backward pass gathers it again)."""
    return [v if s is None else checkpoint_name(jax.lax.with_sharding_constraint(v, s), GATHERED)
            for v, s in zip(values, shardings)]
