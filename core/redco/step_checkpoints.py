"""Step checkpoints: everything a resume needs, written when ``fit`` asks and read back when it
starts, so a rerun of the same command continues from the exact step.

``ckpts/step_<N>`` holds the state (params, optimizer state, rng; ``Trainer.ckpt_tree()``), the
step and epoch, the data (how many examples and the seed, which fix their order; where the
examples have a ``fingerprint`` attribute, that string, which names what they are made of, e.g.
a corpus file's documents and tokens; and the position in them, ``redco/data_order.py``) and
every plugin's ``state_to_save`` (in ``trainer.run(loop=...)``, the loop's ``state_dict()`` too).
``StepCheckpoints`` writes and reads them for the run (``redco/run_context.py``), which decides when;
resuming with other data or another seed is refused naming what changed, since the run would
not see the examples the interrupted one would have (another batch size or number of
processes is fine: the position is counted in examples).

**Writing in the background** (``Trainer(async_checkpoints=True)``, the default, with any
number of processes). ``save`` copies the state to host memory on the training thread, which
is all training waits for (the next update donates the state's device buffers; with several
processes, the format's ``start_save`` may gather arrays there), and a writer thread writes
that copy with the checkpoint format (``redco/ckpt_writes.py``). The writer threads of the
processes meet only at the coordination service's barriers (``jax.distributed``'s, named after
the checkpoint and the save), never on the devices, where training runs its own collectives
meanwhile: process 0 renames the checkpoint into place once every process has written its
part. So a kill of any process at any moment leaves either the complete checkpoint or a
``.tmp`` that resume ignores. At most one write is in flight: the next ``save`` first waits for
it. ``on_checkpoint_saved`` is called on the training thread once the write is complete
(``finished()``, asked at every update). A SIGTERM stop, the end of ``fit``, and an error that
ends it wait for the write in flight; a write that failed raises its error on the training
thread. Every process must write the same way: a run whose processes disagree on
``async_checkpoints`` is refused at its start (``writing_agreed``).
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

from redco import checkpointing
from redco.step_reports import timed


def writing_agreed(background: bool) -> None:
    """Refuse, on every process, a run whose processes disagree on writing step checkpoints in
    the background: the blocking ones would wait for the others on the devices while those meet
    at the coordination service, and the run would hang at its first save."""
    try:
        multihost_utils.assert_equal(np.int32(background))
    except AssertionError:
        raise ValueError(
            f"Process {jax.process_index()} writes step checkpoints "
            f"{'in the background' if background else 'while training waits'}, and another "
            "process the other way: give every process the same async_checkpoints "
            "(Deployer or Trainer).") from None


class StepCheckpoints:
    def __init__(self, trainer: Any):
        self.trainer = trainer
        self.data_position: dict = {}  # fixes the examples' order: must match on resume
        self.batches: tuple | None = None  # (EpochBatches, epoch) being trained: the position
        self.loop: Any = None  # a trainer.run(loop=...)'s loop: its state_dict() saved too
        self._writer: threading.Thread | None = None  # the write in flight
        self._done: list[tuple[str, int]] = []  # (path, step) written, not yet announced
        self._error: BaseException | None = None
        self._n_background = 0  # background saves started

    def start(self, resume: bool, saves: bool) -> dict | None:
        """At a trainer's first fit: resume from the newest step checkpoint (``resume``; its
        meta is returned), or refuse to write (``saves``) step checkpoints beside an earlier
        run's."""
        ckpt_dir = self.trainer.deployer.ckpt_dir
        if saves and jax.process_count() > 1:
            writing_agreed(self.trainer.async_checkpoints)
        if not resume and saves and checkpointing.step_ckpts(ckpt_dir):
            raise ValueError(
                f"{ckpt_dir} holds step checkpoints of an earlier run; with resume=False this "
                "run's would be mixed with (and pruned against) them. Use a new workdir, or "
                "delete the old checkpoints first.")
        return self.resume() if resume else None

    def resume(self) -> dict | None:
        """Restore the newest step checkpoint onto the trainer's state (with its step, and the
        plugins' state through ``on_resume``); its meta, or None where there is none."""
        trainer, deployer = self.trainer, self.trainer.deployer
        checkpointing.recover(deployer.ckpt_dir)
        found = checkpointing.step_ckpts(deployer.ckpt_dir)
        if not found:
            return None
        saved = checkpointing.read_meta(found[-1]).get("data", {})
        changed = [f"{k} was {saved.get(k)}, now {v}" for k, v in self.data_position.items()
                   if saved.get(k) != v]
        if changed:
            raise ValueError(
                f"Cannot resume from {found[-1]}: {'; '.join(changed)}, so this run would not "
                "see the examples the interrupted one would have. Rerun with the same data and "
                "settings, use a new workdir, or pass fit(resume=False) to start over.")
        tree, meta = deployer.load_ckpt(found[-1], trainer.ckpt_tree())
        trainer.set_train_state(step=meta["step"])
        trainer.state = trainer.state.replace(**tree)
        deployer.forget_metrics_after(meta["step"])
        deployer.log_info(f"Resumed from {found[-1]} (step {meta['step']}).")
        state = meta.get("plugins", {"best": meta.get("best", {})})  # (best: redco <= 0.5.x)
        trainer.hooks.on_resume(trainer=trainer, step=meta["step"], state=state)
        return dict(meta, path=found[-1])

    def save(self, epoch: int, keep: int, background: bool = False) -> str:
        """Write ``ckpts/step_<step>`` and keep the newest ``keep``; with ``background``, in the
        background where it can be (module docstring). Returns its path; ``finished()`` tells
        when it is complete."""
        self.join()  # at most one write in flight
        trainer = self.trainer
        step = trainer.step
        data = dict(self.data_position)
        if self.batches is not None:
            batches, at_epoch = self.batches
            data.update(examples_per_step=batches.size, position=batches.state(at_epoch))
        meta = {"step": step, "epoch": epoch, "data": data,
                "plugins": trainer.hooks.saved_state(trainer, step)}
        if self.loop is not None:
            meta["loop"] = self.loop.state_dict()
        name, deployer = f"step_{step}", trainer.deployer
        if not (background and trainer.async_checkpoints) or deployer.workdir is None:
            return self._write(step, trainer.ckpt_tree(), meta, keep)  # (None: its error)
        self._n_background += 1  # (every process counts the same saves: the barriers' names)
        write = checkpointing.save_in_background(
            deployer.ckpt_dir, name, trainer.ckpt_tree(), meta, deployer.checkpoint_format,
            barrier_tag=f"redco-ckpt/{name}/{self._n_background}")
        self._writer = threading.Thread(target=self._write_in_background,
                                        args=(write, step, keep), name=f"redco-ckpt-{name}")
        self._writer.start()
        return f"{deployer.ckpt_dir}/{name}"

    def _write(self, step: int, tree: Any, meta: dict, keep: int) -> str:
        deployer = self.trainer.deployer
        return self._written(deployer.save_ckpt(f"step_{step}", tree, meta), step, keep)

    def _written(self, path: str, step: int, keep: int) -> str:
        checkpointing.prune(self.trainer.deployer.ckpt_dir, keep)
        self._done.append((path, step))
        return path

    def _write_in_background(self, write: Callable[[], str], step: int, keep: int) -> None:
        try:
            self._written(write(), step, keep)
        except BaseException as e:  # noqa: BLE001 - raised on the training thread by finished()
            self._error = e

    def finished(self) -> list[tuple[str, int]]:
        """``(path, step)`` of each write completed since the last call, oldest first; the
        error of a background write that failed."""
        if self._writer is not None and not self._writer.is_alive():
            self.join()
        done, self._done = self._done, []
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"Writing a step checkpoint in the background failed: "
                               f"{type(error).__name__}: {error}. The checkpoints before it are "
                               "kept.") from error
        return done

    def announce(self, wait: bool = False) -> None:
        """``on_checkpoint_saved`` for each step checkpoint written since the last call (with
        ``wait``: once the write in flight is done, the hang watch paused meanwhile)."""
        trainer = self.trainer
        if wait:
            with trainer.hang_watch_paused("waiting for a step checkpoint's background write"), \
                    timed(trainer, "checkpoint"):
                self.join()
        finished = self.finished()
        if finished:
            with trainer.hang_watch_paused():  # a callback may upload it, say
                for path, step in finished:
                    trainer.hooks.on_checkpoint_saved(trainer=trainer, path=path, step=step)

    def join(self) -> None:
        """Wait for the write in flight to end (its error kept for ``finished``)."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
