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
``"none"`` the gathered weights are kept for the backward pass. A layer's gathers wait for its
input activations (a data dependency, ``gather(..., after=)``): a scheduler may not issue them
all at the start of the step, so one layer's gathered weights are alive at a time.

The ``Trainer`` (and the planner, measuring the same step) declares the params of a step:

    with fsdp.gathering(params, shardings):
        loss = loss_fn(params, batch)      # each remat.layer gathers the weights it is given

``remat.layer`` asks ``targets(leaves)`` which of its inputs are declared params and gathers
those (``gather``); a model with no ``remat.layer`` is laid out as XLA chooses.

Stacked layers run under ``jax.lax.scan`` (``redco.layer_stacks``) see one layer's slice of each
declared param in the scan's body, a new array: the body declares the slices
(``slices_of(stacked, slices)``) split as their stacks are less the layer axis, and its
``remat.layer`` gathers one layer's weights per scan step.
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
_declared: list[dict[int, tuple]] = []  # a stack: id(param leaf) -> (gathered, split) shardings


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
    own = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    table = {id(leaf): (target, split) for leaf, target, split in
             zip(jax.tree.leaves(params), gathered, own) if target is not None}
    _declared.append(table)
    try:
        yield
    finally:
        _declared.pop()


@contextlib.contextmanager
def slices_of(stacked: Sequence[Any], slices: Sequence[Any]) -> Iterator[None]:
    """Inside a scan's body: each of ``slices`` (one layer of the matching ``stacked`` param,
    its leading axis gone) declared as its stack is, less that axis; nothing if none is."""
    entries = targets(stacked)
    if not any(entries):
        yield
        return
    drop = lambda s: NamedSharding(s.mesh, P(*s.spec[1:]))  # noqa: E731
    table = dict(_declared[-1])
    table.update({id(leaf): (drop(entry[0]), drop(entry[1]))
                  for leaf, entry in zip(slices, entries) if entry is not None})
    _declared.append(table)
    try:
        yield
    finally:
        _declared.pop()


def keep_split(leaves: Sequence[Any]) -> None:
    """Leave ``leaves`` split where the innermost ``gathering`` declared them, for the rest of
    its trace: a model that computes on a weight where it lies (e.g. in ``shard_map`` over
    ``dp``) says so before its layers run, and no layer gathers it."""
    for leaf in leaves:
        if _declared:
            _declared[-1].pop(id(leaf), None)


def declared(leaf: Any) -> NamedSharding | None:
    """The sharding the innermost ``gathering`` declared ``leaf`` split by (over ``dp`` or
    ``cp``), None for a leaf it did not declare: a model reads where a weight lies (e.g. experts
    split over ``dp``, ``redco_zoo_models.expert_parallel``) before deciding how to compute."""
    entry = _declared[-1].get(id(leaf)) if _declared else None
    return None if entry is None else entry[1]


def targets(leaves: Sequence[Any]) -> list[tuple[NamedSharding, NamedSharding] | None]:
    """For each of a layer's input leaves: ``(gathered, split)`` shardings, the one to gather
    it to and its own, or None for the rest."""
    table = _declared[-1] if _declared else {}
    return [table.get(id(leaf)) for leaf in leaves]


def _zero_after(inputs: Sequence[Any]):
    """A scalar 0 computed from the first floating array of ``inputs`` (no gradient flows
    through it), or None without one."""
    floating = [x for x in inputs if hasattr(x, "dtype") and x.size
                and jax.numpy.issubdtype(x.dtype, jax.numpy.floating)]
    return jax.lax.stop_gradient(floating[0][(0,) * floating[0].ndim]) * 0 if floating else None


def gather(values: Sequence[Any], targets: Sequence[tuple | None],
           after: Sequence[Any] = ()) -> list[Any]:
    """``values`` with each one that has ``(gathered, split)`` shardings gathered and named
    ``GATHERED`` (no remat policy saves it: under one, the backward pass gathers it again).

    The gathers wait for ``after`` (the layer's activations; ``+ 0 * one of their elements``),
    so they run layer by layer: without the tie XLA's CPU scheduler issues every layer's
    gathers at the start of the step and holds all the gathered weights at once (LLaMA-7B
    width, 8 layers, 8k tokens, CP 8, full remat: temp 13.6 GB, 6.8 GB tied)."""
    zero = _zero_after(after) if any(targets) else None
    tie = (lambda v: v) if zero is None else (lambda v: v + zero.astype(v.dtype))
    return [v if t is None else checkpoint_name(_gathered(tie(v), *t), GATHERED)
            for v, t in zip(values, targets)]


def _gathered(x, target: NamedSharding, split: NamedSharding):
    """``x`` gathered from its own shards: constrained to ``split`` first, so that XLA gathers
    after the tie (else it lays the tie out gathered and gathers the weight early)."""
    return jax.lax.with_sharding_constraint(jax.lax.with_sharding_constraint(x, split), target)
