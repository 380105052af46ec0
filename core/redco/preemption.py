"""Stopping a run cleanly when it is told to: a scheduler's SIGTERM (a preemption, or SLURM's
warning before a time limit with ``--signal``), or Ctrl-C (SIGINT).

While ``Trainer.fit`` trains, the first such signal only asks it to stop: the step under way
finishes, one step checkpoint is written (atomically, as always), and ``fit`` raises
``Preempted``, a ``SystemExit`` with status 128 + the signal number (143 for SIGTERM, 130 for
SIGINT), so the command exits saying so and a rerun resumes from that checkpoint. A second SIGINT
exits at once (``KeyboardInterrupt``); a second SIGTERM is ignored, so it cannot cut the save.

With several processes every one must stop at the same boundary of its loop (an update in ``fit``,
a round of a loop of rounds). JAX's preemption service (on in every ``jax.distributed`` run) takes
SIGTERM, tells the other processes, and agrees with them on the boundary to stop at
(``reached_preemption_sync_point``: the one after the furthest any process reached); a SIGINT
here is passed on to it as a SIGTERM of this process. The service matches boundaries by an
increasing number that must step by one, so boundaries are counted here, for the whole process
(a round of many updates is one), not by the trainer's step.
"""
from __future__ import annotations

import os
import signal
import threading

import jax
from jax.experimental import multihost_utils

from redco import _private


class Preempted(SystemExit):
    """``fit`` stopped on a signal after saving a step checkpoint; the exit status is 128 + the
    signal's number."""


_boundaries = 0  # boundaries reached in this process, counted the same on every process


class Watch:
    """Made when a run starts (``redco/run_context.py``), which installs its signal handlers, and
    ``restore``d when it ends; ``stop_after_boundary()`` says whether to stop at this boundary."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._service = jax.process_count() > 1  # JAX's preemption service, if it runs
        if self._service and not _private.preemption_service_on():
            return  # jax_enable_preemption_service is off: signals keep their default actions
        if threading.current_thread() is threading.main_thread():  # signals reach only that one
            own = (signal.SIGINT,) if self._service else (signal.SIGINT, signal.SIGTERM)
            for signum in own:
                self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
            if self._service:  # the preemption service agrees on the step to stop
                os.kill(os.getpid(), signal.SIGTERM)
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt

    def stop_after_boundary(self) -> bool:
        """Whether a signal asks to stop at the boundary just reached (all processes agree)."""
        global _boundaries
        if self._service:
            _boundaries += 1
            if self._previous and multihost_utils.reached_preemption_sync_point(_boundaries):
                self.signum = self.signum or signal.SIGTERM
                return True
            return False
        return self.signum is not None

    def stopped(self, step: int, saved: str | None) -> Preempted:
        """What ``fit`` raises once it stopped after ``step`` (and saved ``saved``)."""
        where = f"saved {saved}; run the same command again to resume" if saved else \
            "nothing saved (workdir=None)"
        error = Preempted(128 + self.signum)
        error.reason = f"Stopped by {signal.Signals(self.signum).name} after step {step}: {where}."
        return error
