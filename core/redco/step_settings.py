"""What a train step is made of, fixed when the ``Trainer`` is made: one frozen object that the
compiled steps are built from and that the layout planner is asked with (``LayoutRequest``
carries it). A change (a new optimizer, the planner's remat policy) makes a new one.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import optax

from redco.train_step import step_loss


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """``Trainer(...)``'s arguments that shape its step (see its docstring). ``make_step``: a
    step of another make (Redco 0.4's ``train_step_fn``, adapted where the Trainer is made):
    ``make_step(settings, loss_of, mesh) -> step``, ``loss_of(per_device)`` as ``loss`` below."""
    loss_fn: Callable
    optimizer: optax.GradientTransformation
    trainable: Any = None
    accumulate_grad_batches: int = 1
    compute_dtype: Any = None
    remat: str | None = None
    lr_schedule_fn: Callable | None = None
    count_tokens: Callable | None = None
    make_step: Callable | None = None

    def replace(self, **changes) -> StepSettings:
        return dataclasses.replace(self, **changes)

    def loss(self, params_shardings: Any = None, mesh: Any = None,
             context_strategy: str = "all_gather") -> Callable:
        """``loss(params, state, batch, rng, is_training)`` under these settings' remat policy
        and compute dtype, gathering FSDP weights by ``params_shardings`` and splitting
        sequences over ``mesh``'s ``cp`` axis (``redco.train_step.step_loss``)."""
        return step_loss(self.loss_fn, params_shardings, self.compute_dtype, self.remat, mesh,
                         context_strategy)
