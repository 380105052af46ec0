"""When a loop writes a step checkpoint: every ``n`` updates, every ``m`` minutes, or both, decided
at the loop's own boundaries (an update in ``fit``, a round in a loop of your own).

**By updates** the rule is a crossing: a boundary saves when the trainer's step has passed a
multiple of ``n`` since the last save. A loop whose boundaries come every update saves at
``n, 2n, 3n, ...``; one whose rounds make several updates saves after the round that reaches or
passes each multiple (rounds of 2 updates, ``n = 3``: after steps 4, 6, 10, 12, ...).

**By time** every process must agree, or one would wait at the save's barriers for a process
that went on training, and both would hang. Each process reads its own clock, so process 0
decides (its clock against its last save) and its answer is broadcast to all
(``broadcast_one_to_all``, as Levanter does): no two processes ever disagree on a boundary.
"""
from __future__ import annotations

import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from redco.data import check_number


class SaveCadence:
    """``due(step)`` at each boundary: whether to write a step checkpoint there;
    ``saved(step)`` once one was written."""

    def __init__(self, every_n_steps: int | None = None, every_minutes: float | None = None,
                 step: int = 0):
        check_number("save_every_n_steps", every_n_steps, 1, optional=True)
        if every_minutes is not None and (isinstance(every_minutes, bool)
                                          or not isinstance(every_minutes, (int, float))
                                          or not every_minutes > 0):
            raise ValueError(f"save_every_minutes={every_minutes!r}: give a positive number of "
                             "minutes, or None.")
        self.every_n_steps = every_n_steps
        self.every_s = None if every_minutes is None else 60.0 * every_minutes
        self.saved(step)

    def saved(self, step: int) -> None:
        """A step checkpoint of ``step`` was written (or the run starts at ``step``)."""
        self.last_step, self.last_time = step, time.monotonic()

    def due(self, step: int) -> bool:
        """Whether the boundary after ``step`` saves (the same answer on every process)."""
        if step == self.last_step:
            return False
        n = self.every_n_steps
        if n and step // n > self.last_step // n:
            return True
        return self.every_s is not None and self._time_is_up()

    def _time_is_up(self) -> bool:
        up = time.monotonic() - self.last_time >= self.every_s
        if jax.process_count() > 1:  # process 0's clock decides for all
            up = bool(multihost_utils.broadcast_one_to_all(np.int32(up)))
        return up
