"""``fit``'s guarantees for any training loop: GRPO's rounds, PPO's episodes, FedAvg's rounds, a
user's own ``for`` loop.

::

    with trainer.run(loop=my_loop, save_every_n_steps=100) as run:
        for round_ in range(my_loop.round, n_rounds):   # my_loop.round: restored on resume
            ...  # sample, score, trainer.train_scanned(...) / train_epoch(...)
            my_loop.round = round_ + 1
            run.step_done()                              # save, stop on SIGTERM, as due

Entering the run:

* resumes from the newest step checkpoint in ``workdir/ckpts`` (``resume=True``): the trainer's
  params, optimizer state and rng, its step, the plugins' state, and the loop's own state
  (``loop.load_state_dict(d)`` with what ``loop.state_dict()`` returned when it was saved: a
  JSON-able dict, e.g. the round counter and the position in the prompts); ``run.resumed_from``
  names the checkpoint (None: a fresh start);
* catches SIGTERM and SIGINT, and starts the hang watchdog (``Trainer(hang_timeout_s=)``).

``run.step_done()``, called after each unit of the loop (an update, a round), then:

* on a signal: writes a step checkpoint and raises ``redco.preemption.Preempted`` (exit status
  143 for SIGTERM), so a rerun of the same command resumes where it stopped;
* every ``save_every_n_steps`` updates (counted by the trainer's step, so a round of several
  updates counts them all) or ``save_every_minutes``: writes a step checkpoint, in the
  background, keeping the newest ``keep_last_ckpts``.

Leaving it waits for the write in flight and, with ``save_at_end``, writes a final one; a lost
process of a multi-process run is named in the error, as in ``fit``. Enter the run once the
trainer's layout is decided (after a first ``lower_train_step``, ``train_epoch`` or
``train_scanned``): the restored state is placed on it.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

from redco.data import check_number
from redco.epoch_loop import stop_on_signal
from redco.run_guard import RunGuard
from redco.step_reports import timed

if TYPE_CHECKING:  # annotations only (trainer.py imports this module)
    from redco.trainer import Trainer


class LoopState(Protocol):
    """A loop whose own state (counters, positions, seeds) is saved with each step checkpoint."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class RunContext:
    """``with trainer.run(...) as run`` (module docstring)."""

    def __init__(self, trainer: Trainer, loop: LoopState | None = None,
                 save_every_n_steps: int | None = None, save_every_minutes: float | None = None,
                 keep_last_ckpts: int = 1, resume: bool = True, save_at_end: bool = True):
        check_number("save_every_n_steps", save_every_n_steps, 1, optional=True)
        check_number("keep_last_ckpts", keep_last_ckpts, 1)
        if save_every_minutes is not None and not save_every_minutes > 0:
            raise ValueError(f"save_every_minutes={save_every_minutes}: give a positive number "
                             "of minutes, or None.")
        if trainer.state is None:
            raise RuntimeError("trainer.run() restores the state onto the trainer's layout, "
                               "which is not decided yet: call trainer.lower_train_step(examples, "
                               "per_device_batch_size) (or train once) first.")
        self.trainer, self.loop, self.keep = trainer, loop, keep_last_ckpts
        self.every_steps, self.resume, self.save_at_end = save_every_n_steps, resume, save_at_end
        self.every_s = None if save_every_minutes is None else 60 * save_every_minutes
        self.resumed_from: str | None = None
        self._guard = RunGuard(trainer)
        self._last_save: tuple[int, float] = (trainer.step, time.monotonic())

    def __enter__(self) -> RunContext:
        trainer = self.trainer
        trainer.checkpoints.loop = self.loop
        self._guard.__enter__()
        try:
            meta = trainer.checkpoints.start(self.resume, saves=trainer.deployer.workdir is not None)
        except BaseException as error:
            self._guard.__exit__(type(error), error, error.__traceback__)
            raise
        if meta is not None:
            self.resumed_from = meta["path"]
            if self.loop is not None:
                self.loop.load_state_dict(meta.get("loop", {}))
        self._last_save = (trainer.step, time.monotonic())
        trainer.hooks.on_run_start(trainer=trainer, resumed_from=self.resumed_from)
        return self

    def timed(self, phase: str):
        """``with run.timed("rollout"):`` around a part of the loop that is not an update: its
        time goes to ``phase`` in ``goodput.json`` (``redco/observers/goodput.py``)."""
        return timed(self.trainer, phase)

    def step_done(self) -> None:
        """After a unit of the loop: stop on a signal (saving first), save when due."""
        trainer, step = self.trainer, self.trainer.step
        if trainer.guard.stop_after(step):
            stop_on_signal(trainer, 0, step, self.keep)
        trainer.guard.progress(step)
        if self._due(step) and trainer.deployer.workdir is not None:
            trainer.save_step_ckpt(0, self.keep, background=True)
            self._last_save = (step, time.monotonic())
        trainer.checkpoints.announce()

    def _due(self, step: int) -> bool:
        last_step, last_time = self._last_save
        if step == last_step:
            return False
        by_steps = self.every_steps and step // self.every_steps > last_step // self.every_steps
        by_time = self.every_s is not None and time.monotonic() - last_time >= self.every_s
        return bool(by_steps or by_time)

    def __exit__(self, kind, error, traceback) -> bool | None:
        trainer = self.trainer
        try:
            if error is None and self.save_at_end and trainer.deployer.workdir is not None \
                    and self._last_save[0] != trainer.step:
                trainer.save_step_ckpt(0, self.keep)
            trainer.checkpoints.announce(wait=error is None)
        finally:
            trainer.checkpoints.loop = None
            handled = self._guard.__exit__(kind, error, traceback)
            trainer.hooks.on_run_end(trainer=trainer)
        return handled
