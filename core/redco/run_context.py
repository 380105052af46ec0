"""The run context: the one place that resumes a run, stops it on a signal and decides when to
save, for every training loop: ``fit``, GRPO's rounds, PPO's episodes, FedAvg's rounds, MAML, a
user's own ``for`` loop.

::

    trainer.prepare(examples, per_device_batch_size)    # the layout, decided and placed
    with trainer.run(loop=my_loop, save_every_n_steps=100) as run:
        for round_ in range(my_loop.round, n_rounds):   # my_loop.round: restored on resume
            ...  # sample, score, trainer.train_scanned(...) / train_epoch(...)
            my_loop.round = round_ + 1
            run.step_done()                              # save, stop on SIGTERM, as due

**Boundaries.** A loop is consistent only between its own units: a FedAvg round half done holds a
client's params, not the server's. So a run acts only at its loop's boundaries: ``fit``'s are its
updates, a ``trainer.run`` loop's are its ``run.step_done()`` calls (the updates inside a round,
``train_epoch``'s or ``train_scanned``'s, are not). At a boundary it

* stops on a signal (SIGTERM, SIGINT; ``redco/preemption.py``): writes a step checkpoint and raises
  ``Preempted`` (exit status 143 for SIGTERM), so a rerun of the same command resumes there. With
  several processes JAX's preemption service agrees on the boundary to stop at; boundaries are
  counted one by one, so a round of many updates is one boundary;
* saves when due (``redco/save_cadence.py``: every ``save_every_n_steps`` updates, counted by the
  trainer's step, or ``save_every_minutes``, decided by process 0 for all), in the background,
  keeping the newest ``keep_last_ckpts``.

**Entering** resumes from the newest step checkpoint in ``workdir/ckpts`` (``resume=True``): the
trainer's params, optimizer state and rng, its step, the plugins' state, and the loop's own state
(``loop.load_state_dict(d)`` with what ``loop.state_dict()`` returned when it was saved);
``run.resumed_from`` names the checkpoint (None: a fresh start). It starts the hang watchdog
(``Trainer(hang_timeout_s=)``; ``redco/watchdog.py``), for which a step checkpoint's save is
bounded by the timeout too.

**Leaving** waits for the write in flight and, with ``save_at_end``, writes a final one; a lost
process of a multi-process run is named in the error. A SIGKILL anywhere leaves the last complete
checkpoint, which is always one written at a boundary.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Protocol

import jax

from redco import preemption, watchdog
from redco.data import check_number
from redco.save_cadence import SaveCadence
from redco.step_reports import timed


class LoopState(Protocol):
    """A loop whose own state (counters, positions, seeds) is saved with each step checkpoint."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class RunContext:
    """``with trainer.run(...) as run`` (module docstring); ``fit`` runs on one whose boundaries
    are its updates (``each_update``), resuming only where ``resume`` (None: a trainer that goes on
    from its own state, neither resuming nor checking the workdir)."""

    def __init__(self, trainer: Any, loop: LoopState | None = None,
                 save_every_n_steps: int | None = None, save_every_minutes: float | None = None,
                 keep_last_ckpts: int = 1, resume: bool | None = True, save_at_end: bool = True,
                 each_update: bool = False, saves: bool | None = None):
        check_number("keep_last_ckpts", keep_last_ckpts, 1)
        self.cadence = SaveCadence(save_every_n_steps, save_every_minutes, trainer.step)
        if trainer.state is None:
            raise RuntimeError("trainer.run() restores the state onto the trainer's layout, which "
                               "is not decided yet: call trainer.prepare(examples, "
                               "per_device_batch_size) first.")
        self.trainer, self.loop, self.keep = trainer, loop, keep_last_ckpts
        self.resume, self.save_at_end, self.each_update = resume, save_at_end, each_update
        self.writes = trainer.deployer.workdir is not None
        self.saves = self.writes if saves is None else saves  # this run means to write any
        self.resumed: dict | None = None  # the meta of the checkpoint resumed from
        self.watch: preemption.Watch | None = None
        self.watchdog: watchdog.Watchdog | None = None

    @property
    def resumed_from(self) -> str | None:
        return None if self.resumed is None else self.resumed["path"]

    def __enter__(self) -> RunContext:
        trainer = self.trainer
        if trainer.context is not None:
            raise RuntimeError("A trainer runs one loop at a time: this one is already inside "
                               "fit() or trainer.run(). Call train_epoch/train_scanned inside it.")
        self.watch = preemption.Watch()  # SIGTERM, SIGINT: save and stop at a boundary
        if trainer.hang_timeout_s:
            self.watchdog = watchdog.Watchdog(trainer.hang_timeout_s)
        trainer.context, trainer.checkpoints.loop = self, self.loop
        try:
            self._resume()
        except BaseException:
            self._leave()
            raise
        if not self.each_update:
            trainer.hooks.on_run_start(trainer=trainer, resumed_from=self.resumed_from)
        return self

    def _resume(self) -> None:
        if self.resume is None:
            return
        meta = self.trainer.checkpoints.start(self.resume, saves=self.saves)
        if meta is not None:
            self.resumed = meta
            if self.loop is not None:
                self.loop.load_state_dict(meta.get("loop", {}))
        self.cadence.saved(self.trainer.step)

    # ---- the loop's boundaries ----------------------------------------------------------------
    def step_done(self) -> None:
        """After a unit of a ``trainer.run`` loop: stop on a signal (saving first), save when
        due."""
        self.progress(self.trainer.step)
        self.boundary(epoch=None)

    def update_done(self, epoch: int, flush: Callable[[], None], epoch_ends: bool) -> None:
        """After each update of ``train_epoch``: a boundary in ``fit`` (not in a loop of rounds,
        whose boundary is its ``step_done``); ``flush`` reports the metrics still pending;
        ``epoch_ends``: the epoch's end saves, not the cadence."""
        if self.each_update:
            self.boundary(epoch, flush, may_save=not epoch_ends)
        else:
            self.trainer.checkpoints.announce()  # (a write's end, or its error, seen at once)

    def boundary(self, epoch: int | None, flush: Callable[[], None] = lambda: None,
                 may_save: bool = True) -> None:
        """Stop on a signal all processes agreed on (saving first); else save when due."""
        step = self.trainer.step
        self.trainer.checkpoints.announce()  # the writes done since; a failed one raises here
        stop = self.watch.stop_after_boundary()
        due = not stop and may_save and self.cadence.due(step)
        if stop or due:
            flush()
        if stop:
            self._stop(epoch, step)
        if due:
            self.save(epoch, background=True)

    def _stop(self, epoch: int | None, step: int) -> None:
        saved = self.save(epoch) if self.writes else None
        error = self.watch.stopped(step, saved)
        self.trainer.deployer.log_info(error.reason)
        raise error

    def save(self, epoch: int | None = None, background: bool = False) -> str | None:
        """A step checkpoint of the trainer now (None without a workdir)."""
        if not self.writes:
            return None
        path = self.trainer.save_step_ckpt(epoch, self.keep, background)
        self.cadence.saved(self.trainer.step)
        return path

    # ---- the hang watchdog ----------------------------------------------------------------------
    def progress(self, step: int) -> None:
        """``step`` is done: the hang watchdog's clock starts again."""
        if self.watchdog is not None:
            self.watchdog.progress(step)

    def paused(self, waiting_for: str | None = None):
        """The hang watchdog paused meanwhile; ``waiting_for``: for no longer than its timeout."""
        return self.watchdog.paused(waiting_for) if self.watchdog is not None \
            else contextlib.nullcontext()

    def timed(self, phase: str):
        """``with run.timed("rollout"):`` around a part of the loop that is not an update: its
        time goes to ``phase`` in ``goodput.json`` (``redco/observers/goodput.py``)."""
        return timed(self.trainer, phase)

    def __exit__(self, kind, error, traceback) -> None:
        trainer = self.trainer
        try:
            if error is None and self.save_at_end and self.cadence.last_step != trainer.step:
                self.save()
            trainer.checkpoints.announce(wait=error is None)
        finally:
            try:
                if isinstance(error, jax.errors.JaxRuntimeError) and jax.process_count() > 1:
                    raise trainer.deployer.lost_process_error(error) from error
            finally:
                self._leave()
                if not self.each_update:
                    trainer.hooks.on_run_end(trainer=trainer)

    def _leave(self) -> None:
        """The write in flight completed (whatever ended the run), the signals and the watchdog
        given back."""
        trainer = self.trainer
        trainer.context, trainer.checkpoints.loop = None, None
        try:
            trainer.checkpoints.join()
        finally:
            self.watch.restore()
            if self.watchdog is not None:
                self.watchdog.stop()
