"""The learning-rate schedule ``Deployer.get_lr_schedule_fn`` makes: warmup, then linear or
cosine decay, counted in optimizer updates, at ``end_learning_rate`` exactly from the run's
last update on. A warmup that would not end before that last update is refused (the run would
end below its peak, or at the peak instead of the end value), once the run's length is known.

Its length, the run's number of updates, depends on the data-parallel size. Under
``n_model_shards="auto"`` that size is known only once the layout planner has picked a layout
(at ``fit``'s first batch), so the schedule counts its updates when first asked after that
(``total_steps``, or the train step traced for the picked layout). While the planner compiles
its candidates, before any is picked, it is traced as if each update took one device's batch:
its values change nothing a step holds in memory.

Computed inside the jitted step, XLA multiplies by a reciprocal where optax divides, and a
linear decay to 0 ended at -4.5e-11, a rate that steps uphill: the values are kept within the
schedule's range, and the last update's is the end value exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax.numpy as jnp
import optax

from redco.data import check_number


@dataclass
class LrSchedule:
    updates_per_epoch: Callable[[], int | None]  # None: the layout is not picked yet
    stand_in_updates: int  # per epoch, while it is not (as if on one device)
    n_epochs: int
    learning_rate: float
    schedule_type: str = "linear"
    warmup_rate: float = 0.0
    warmup_steps: int | None = None
    init_learning_rate: float = 0.0
    end_learning_rate: float = 0.0

    def __post_init__(self):
        for name, value, low, high, integer, optional in (
                ("n_epochs", self.n_epochs, 1, None, True, False),
                ("learning_rate", self.learning_rate, 0, None, False, False),
                ("warmup_rate", self.warmup_rate, 0, 1, False, False),
                ("warmup_steps", self.warmup_steps, 0, None, True, True),
                ("init_learning_rate", self.init_learning_rate, 0, None, False, False),
                ("end_learning_rate", self.end_learning_rate, 0, None, False, False)):
            check_number(name, value, low, high, integer, optional)
        if self.schedule_type not in ("linear", "cosine"):
            raise ValueError(f"schedule_type={self.schedule_type!r}: use 'linear' or 'cosine'.")
        per_epoch = self.updates_per_epoch()  # None until the layout is picked: checked then
        if per_epoch is not None:
            self._warmup(self.n_epochs * per_epoch)

    def _warmup(self, total: int) -> int:
        """The warmup's updates in a run of ``total``; refused where it would not end before
        the run's last update (which would then train at no end value, or below the peak)."""
        warmup = self.warmup_steps if self.warmup_steps is not None else \
            int(self.warmup_rate * total)
        if warmup and warmup >= total - 1:
            given = (f"warmup_steps={warmup}" if self.warmup_steps is not None else
                     f"warmup_rate={self.warmup_rate} ({warmup} updates)")
            raise ValueError(f"{given} in a run of {total} updates: the warmup must end before "
                             "the run's last update, which trains at end_learning_rate. Give "
                             f"fewer than {total - 1} warmup updates.")
        return warmup

    @property
    def total_steps(self) -> int:
        """The run's updates (the layout is picked by now)."""
        return self.n_epochs * self.updates_per_epoch()

    def __call__(self, count):
        per_epoch = self.updates_per_epoch()
        total = self.n_epochs * (self.stand_in_updates if per_epoch is None else per_epoch)
        return self._schedule(total)(count)

    def _schedule(self, total: int) -> Callable:
        lr, end = self.learning_rate, self.end_learning_rate
        warmup = self._warmup(total)
        decay_steps = max(total - 1 - warmup, 0)
        decay = optax.linear_schedule(lr, end, decay_steps) if self.schedule_type == "linear" \
            else optax.cosine_decay_schedule(lr, max(decay_steps, 1), end / lr if lr else 0.0)
        joined = optax.join_schedules(
            [optax.linear_schedule(self.init_learning_rate, lr, warmup), decay], [warmup])
        low, high = sorted((self.init_learning_rate, lr, end))[::2]
        last = total - 1 if decay_steps else total  # (no decay: no end value to reach)
        return lambda count: jnp.where(count >= last, end, jnp.clip(joined(count), low, high))
