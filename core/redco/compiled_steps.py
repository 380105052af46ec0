"""The Trainer's compiled functions, made once its layout is decided (``trainer_state.py``) and
made again when its optimizer or model is replaced.

- ``train``: the train step ``(state, batch) -> (state, metrics)``, jitted for the state's
  layout with the state donated; ``epoch_loop.py`` and ``run_context.py`` run it.
- ``scanned``: many updates in one call (``scanned_updates.py``), made at the first use.
- ``eval_step``: ``loss_fn`` on a batch, not training (``Trainer.eval_loss``).
- ``lower(...)`` and ``flops()``: the train step ahead of time, for ``Trainer.lower_train_step``
  and ``Trainer.step_flops``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import jax

from redco import compat
from redco.data import n_full_batches
from redco.step_flops import step_flops as count_step_flops
from redco.train_step import TrainState, loss_and_metrics, make_train_step

if TYPE_CHECKING:
    from redco.trainer import Trainer


class CompiledSteps:
    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.train = self.jit_train()
        self.scanned: Callable | None = None  # made at the first train_scanned
        self.eval_step = jax.jit(self.eval_loss)
        self.first_run = False  # the train step has run once (compiled, timed, logged)
        self.batch_shapes = None  # of the first batch the train step ran on, for its FLOPs
        self._flops: float | None = None

    def step(self, unroll: bool = False) -> Callable:
        """The train step, not jitted; ``unroll``: the micro-batch loop unrolled, for counting
        FLOPs only."""
        t = self.trainer
        return compat.flax_train_step(t.train_step_fn, t) if t.train_step_fn else \
            make_train_step(t._loss, t.optimizer, t.trainable, t.accumulate_grad_batches,
                            t.lr_schedule_fn, t.count_tokens, unroll)

    def jit_train(self, unroll: bool = False) -> Callable:
        """The train step, jitted for the state's layout (its state donated)."""
        t = self.trainer
        return jax.jit(self.step(unroll), in_shardings=(t.state_shardings, None),
                       out_shardings=(t.state_shardings, t.deployer.replicated), donate_argnums=0)

    def eval_loss(self, state: TrainState, batch):
        return loss_and_metrics(self.trainer._loss(state.params, state, batch, state.rng, False))[0]

    def flops(self) -> float | None:
        """FLOPs of one whole update (``Trainer.step_flops``); None before the first update."""
        if self.batch_shapes is not None and self._flops is None:
            step = self.train if self.trainer.accumulate_grad_batches == 1 else \
                self.jit_train(unroll=True)  # (one micro-batch: the trace jit has kept)
            self._flops = count_step_flops(step.trace(self.trainer.state, self.batch_shapes))
        return self._flops

    def lower(self, examples: Sequence, per_device_batch_size: int) -> jax.stages.Lowered:
        """The train step lowered for the first batch of ``examples`` (``Trainer.lower_train_step``)."""
        t = self.trainer
        batch_size = t.deployer.get_global_batch_size(per_device_batch_size)
        batch_size *= t.accumulate_grad_batches
        n_full_batches(len(examples), batch_size, "examples")
        batch = t.deployer.make_batch(list(examples[:batch_size]), t.collate_fn,
                                      n_micro=t.accumulate_grad_batches)
        return self.train.lower(t.state, batch)
