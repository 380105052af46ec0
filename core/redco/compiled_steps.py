"""A trainer's compiled functions, made for its settings (``step_settings.py``) on its placed
state's layout, and made again when its optimizer or model is replaced (``trainer_state.py``).

- ``train``: the train step ``(state, batch) -> (state, metrics)``, jitted for the state's
  layout with the state donated; ``epoch_loop.py`` runs it.
- ``scanned``: many updates in one call (``scanned_updates.py``), made at the first use.
- ``eval_step``: ``loss_fn`` on a batch, not training (``Trainer.eval_loss``).
- ``lower(...)`` and ``flops(...)``: the train step ahead of time, for ``Trainer.lower_train_step``
  and ``Trainer.step_flops``.
"""
from __future__ import annotations

from typing import Any, Callable

import jax

from redco.step_flops import step_flops as count_step_flops
from redco.step_settings import StepSettings
from redco.train_step import TrainState, loss_and_metrics, make_train_step


class CompiledSteps:
    def __init__(self, settings: StepSettings, state_shardings: TrainState, mesh: Any,
                 context_strategy: str = "all_gather"):
        self.settings, self.shardings = settings, state_shardings
        self.mesh, self.context_strategy = mesh, context_strategy
        self.train = self.jit_train()
        self.scanned: Callable | None = None  # made at the first train_scanned
        self.eval_step = jax.jit(self.eval_loss)
        self.first_run = False  # the train step has run once (compiled, timed, logged)
        self.batch_shapes = None  # of the first batch the train step ran on, for its FLOPs
        self._flops: float | None = None

    def loss(self, per_device: bool = False) -> Callable:
        """``loss_fn`` under the step's remat policy and FSDP gathers (none ``per_device``:
        inside a ``shard_map``, where params are a device's own copy)."""
        if per_device:
            return self.settings.loss(context_strategy=self.context_strategy)
        return self.settings.loss(self.shardings.params, self.mesh, self.context_strategy)

    def step(self, unroll: bool = False) -> Callable:
        """The train step, not jitted; ``unroll``: the micro-batch loop unrolled, for counting
        FLOPs only."""
        s = self.settings
        if s.make_step is not None:
            return s.make_step(s, self.loss, self.mesh)
        return make_train_step(self.loss(), s.optimizer, s.trainable, s.accumulate_grad_batches,
                               s.lr_schedule_fn, s.count_tokens, unroll)

    def jit_train(self, unroll: bool = False) -> Callable:
        """The train step, jitted for the state's layout (its state donated)."""
        replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        return jax.jit(self.step(unroll), in_shardings=(self.shardings, None),
                       out_shardings=(self.shardings, replicated), donate_argnums=0)

    def eval_loss(self, state: TrainState, batch):
        return loss_and_metrics(self.loss()(state.params, state, batch, state.rng, False))[0]

    def flops(self, state: TrainState) -> float | None:
        """FLOPs of one whole update (``Trainer.step_flops``); None before the first update."""
        if self.batch_shapes is not None and self._flops is None:
            step = self.train if self.settings.accumulate_grad_batches == 1 else \
                self.jit_train(unroll=True)  # (one micro-batch: the trace jit has kept)
            self._flops = count_step_flops(step.trace(state, self.batch_shapes))
        return self._flops
