"""Context parallelism's switch: which mesh axis splits the sequence while a train step (or a
prediction) is traced. ``Deployer(n_context_shards=k)`` puts a ``cp`` axis of k devices in the
mesh; the Trainer traces the user's loss inside ``splitting(mesh)``, the Predictor its
``pred_fn``; a model whose attention can run over a split sequence asks ``current()`` and, when
it gets ``(mesh, axis, strategy)``, lays its activations out along that axis (the zoo's:
``redco_zoo_models.context_parallel``). A function traced under a split that no model asked for
is refused: the mesh would hold ``cp`` devices that split nothing.

The same kind of trace-time context as the remat policy (``redco.remat.policy``) and the FSDP
gathers (``redco.fsdp.gathering``).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from jax.sharding import Mesh

AXIS = "cp"
STRATEGIES = ("all_gather", "ring")
_state = threading.local()


class SplitNotAsked(ValueError):
    """A loss was traced with the sequence split, and no model in it asked how to split it."""


@contextlib.contextmanager
def splitting(mesh: Mesh | None, strategy: str = "all_gather") -> Iterator[None]:
    """Trace what runs inside with the sequence split over ``mesh``'s ``cp`` axis (nothing when
    it has none); on leaving, refuse a split no model asked for."""
    if mesh is None or AXIS not in mesh.axis_names or mesh.shape[AXIS] == 1:
        yield
        return
    previous, _state.split = getattr(_state, "split", None), {"mesh": mesh, "strategy": strategy,
                                                              "asked": False}
    try:
        yield
        if not _state.split["asked"]:
            raise SplitNotAsked(
                f"n_context_shards={mesh.shape[AXIS]} splits the sequence over {mesh.shape[AXIS]} "
                "devices, but the model never asked how (redco.sequence_split.current()): its "
                "attention cannot run over a split sequence. Use a zoo LLaMA-family or GPT-2 "
                "model, or set n_context_shards=1.")
    finally:
        _state.split = previous


def current() -> tuple[Mesh, str, str] | None:
    """``(mesh, axis, strategy)`` while a split is in force, else None."""
    split = getattr(_state, "split", None)
    if split is None:
        return None
    split["asked"] = True
    return split["mesh"], AXIS, split["strategy"]
