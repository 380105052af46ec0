"""Built-in checkpoint format ``orbax``: sharded arrays saved by every process, restored onto
whatever shardings the target asks for (another mesh, another process count, one device)."""
from __future__ import annotations

import orbax.checkpoint as ocp

from redco.plugins import hookimpl


class OrbaxFormat:
    def save(self, path: str, tree) -> None:
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(path, tree)
            ckptr.wait_until_finished()

    def load(self, path: str, target):
        with ocp.StandardCheckpointer() as ckptr:
            return ckptr.restore(path, target)


@hookimpl(trylast=True)
def register_checkpoint_formats(register):
    register("orbax", OrbaxFormat())
