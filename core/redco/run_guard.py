"""``RunGuard``: what stands watch while a trainer trains, in ``fit`` and in ``trainer.run``.

Entered when training starts and left when it ends (``with RunGuard(trainer):``, which sets
``trainer.guard`` meanwhile), it

* catches SIGTERM and SIGINT (``redco/preemption.py``): ``stop_after(step)`` then says to save
  and stop after that update;
* runs the hang watchdog when ``trainer.hang_timeout_s`` is set (``redco/watchdog.py``): ``progress(step)``
  after each update, ``paused()`` around long work that is not one (a checkpoint, an evaluation);
* names the lost process when a multi-process run fails in a collective;
* waits, whatever ended training, for the step checkpoint still being written.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import jax

from redco import preemption, watchdog

if TYPE_CHECKING:  # annotations only (trainer.py imports this module)
    from redco.trainer import Trainer


class RunGuard:
    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.watch: preemption.Watch | None = None
        self.watchdog: watchdog.Watchdog | None = None

    def __enter__(self) -> RunGuard:
        self.watch = preemption.Watch()  # SIGTERM, SIGINT: save a checkpoint and stop
        timeout = self.trainer.hang_timeout_s
        if timeout:  # no update for that long: exit naming the stuck process
            self.watchdog = watchdog.Watchdog(timeout)
        self.trainer.guard = self  # read by the loop while training
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self.trainer.guard = None  # training has ended, whatever ended it
        try:
            if isinstance(error, jax.errors.JaxRuntimeError) and jax.process_count() > 1:
                raise self.trainer.deployer.lost_process_error(error) from error
        finally:
            self.trainer.checkpoints.join()  # a write in flight completes whatever ended training
            self.watch.restore()
            if self.watchdog is not None:
                self.watchdog.stop()

    def stop_after(self, step: int) -> bool:
        """Whether a signal asks to stop once ``step`` is done (all processes agree)."""
        return self.watch.stop_after(step)

    def progress(self, step: int) -> None:
        """``step`` is done: the hang watchdog's clock starts again."""
        if self.watchdog is not None:
            self.watchdog.progress(step)

    def paused(self):
        """The hang watchdog paused meanwhile."""
        return self.watchdog.paused() if self.watchdog is not None else contextlib.nullcontext()
