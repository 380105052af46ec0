"""The default checkpoint format, ``orbax``: every process writes its own shards (tensorstore),
and reading puts each shard straight onto the device that needs it; best for big models and
many hosts. Arrays are stored as nested dicts keyed by their path's parts.

In the background (``start_save``) it is orbax's own asynchronous save: each process copies its
shards to host memory on the training thread, and the writer thread waits for orbax's writing,
whose steps across processes meet at the coordination service's barriers, not on the devices.

orbax is imported at the first save or load, not with the plugin: its import takes about a
quarter of a second, which a start would otherwise spend before its first step."""
from __future__ import annotations

from redco.checkpointing import nest, unflatten_like
from redco.plugins import hookimpl
from redco.protocols import CheckpointFormat


class OrbaxFormat(CheckpointFormat):
    def save(self, path: str, tree) -> None:
        import orbax.checkpoint as ocp
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(path, nest(tree))
            ckptr.wait_until_finished()

    def start_save(self, path: str, tree):
        import orbax.checkpoint as ocp
        ckptr = ocp.AsyncCheckpointer(ocp.StandardCheckpointHandler())
        ckptr.save(path, args=ocp.args.StandardSave(nest(tree)))  # returns once on host

        def finish() -> None:
            with ckptr:  # (closed once written)
                ckptr.wait_until_finished()
        return finish

    def load(self, path: str, target):
        import orbax.checkpoint as ocp
        item = nest(target)
        restore_args = ocp.checkpoint_utils.construct_restore_args(item)
        with ocp.PyTreeCheckpointer() as ckptr:
            restored = ckptr.restore(path, args=ocp.args.PyTreeRestore(
                item=item, restore_args=restore_args, partial_restore=True))
        return unflatten_like(target, restored)


@hookimpl(trylast=True)
def register_checkpoint_formats(register):
    register("orbax", OrbaxFormat())
