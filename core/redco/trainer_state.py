"""A trainer's state over its life: the layout decided and the state placed, once, at the first
batch (``decide_layout``), then replaced mid-run by ``Trainer.set_train_state`` (new params,
optimizer state or step: a FedAvg client, MAML; Redco 0.4's new optimizer or model). The
placement itself is ``redco/state_placement.py``'s.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import jax
import jax.numpy as jnp

from redco import compat, state_placement
from redco import remat as redco_remat
from redco.compiled_steps import CompiledSteps
from redco.data import check_collated, n_full_batches
from redco.sharding import dataflow_trace
from redco.train_step import TrainState

if TYPE_CHECKING:  # annotations only (trainer.py imports this module)
    from redco.trainer import Trainer


def decide_layout(trainer: Trainer, examples: Sequence, per_device_batch_size: int) -> None:
    """``Trainer.prepare``: at the first batch, the deployer fixes the mesh and the final
    rules (from the loss's dataflow, traced on one device's batch, unless rules were given);
    then the state is placed, once."""
    if trainer.state is not None:
        return
    n_full_batches(examples, per_device_batch_size, "train_examples")
    rows = list(examples[:per_device_batch_size])
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                         check_collated(trainer.collate_fn(rows), len(rows)))
    start = trainer._start

    def loss(params, batch):
        state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=None,
                           rng=jax.random.PRNGKey(0), apply_fn=start["apply_fn"])
        return trainer._loss(params, state, batch, jax.random.PRNGKey(0), True)
    n_layers = redco_remat.layers_traced()
    out = jax.eval_shape(loss, start["params"], batch)
    state_placement.check_traced_loss(out, trainer.remat, n_layers, redco_remat.layers_traced())
    trainer.params_sharding_rules = trainer.deployer.decide_layout(
        start["params"], trainer.params_sharding_rules, trace_fn=dataflow_trace(loss, batch),
        plan=(loss, batch, trainer.optimizer, trainer.remat, trainer.trainable,
              trainer.accumulate_grad_batches))
    adopt_planned_remat(trainer)
    trainer.state_shardings = state_placement.state_shardings(
        trainer.deployer, start["params"], trainer.params_sharding_rules, trainer.optimizer,
        trainer.trainable, start["apply_fn"])
    trainer.state = state_placement.initial_state(
        trainer.deployer, trainer.state_shardings, start["params"], start["opt_state"],
        start["step"], trainer.optimizer, trainer.trainable)
    trainer._start = None
    trainer.steps = CompiledSteps(trainer)


def adopt_planned_remat(trainer: Trainer) -> None:
    """``Trainer(remat=None)`` under ``n_model_shards="auto"``: take the policy the planner
    fitted the layout with (before the steps are traced; jit traces at the first call)."""
    if trainer.remat is None and trainer.deployer.layout is not None:
        trainer.remat = redco_remat.check(trainer.deployer.layout.remat)
        trainer.deployer.log_info(f"Trainer: remat={trainer.remat!r}, as planned")


def set_train_state(trainer: Trainer, params: Any, opt_state: Any, step: int | None,
                    v04_options: dict) -> None:
    """``Trainer.set_train_state`` (its docstring)."""
    compat.refuse_unknown("set_train_state()", v04_options,  # Redco 0.4.x's keywords
                          {"apply_fn", "optimizer", "params_sharded", "opt_state_sharded"})
    apply_fn = trainer._start["apply_fn"] if trainer.state is None else trainer.state.apply_fn
    optimizer = v04_options.get("optimizer")
    optimizer = optimizer if optimizer is not trainer.optimizer else None
    apply_fn = v04_options.get("apply_fn") if v04_options.get("apply_fn") != apply_fn else None
    if optimizer is not None or apply_fn is not None:
        replace_optimizer_or_model(trainer, optimizer, apply_fn)
    if optimizer is not None and params is None and opt_state is None:
        params = trainer.params  # the new optimizer's state starts fresh
    if params is not None:
        params = compat.params_for_optimizer(trainer.optimizer, params)
    if trainer.state is None:
        new = {"params": params, "step": step} if params is not None else {"step": step}
        trainer._start.update({k: v for k, v in new.items() if v is not None})
        if params is not None or opt_state is not None:
            trainer._start["opt_state"] = opt_state
        return
    if params is not None:
        trainer.state = state_placement.with_params(trainer.state, trainer.state_shardings, params,
                                                    opt_state, trainer.optimizer, trainer.trainable)
    elif opt_state is not None:
        trainer.state = trainer.state.replace(
            opt_state=state_placement.place_copy(opt_state, trainer.state_shardings.opt_state))
    if step is not None:
        trainer.state = trainer.state.replace(
            step=state_placement.placed_step(trainer.deployer, step))


def replace_optimizer_or_model(trainer: Trainer, optimizer=None, apply_fn=None) -> None:
    """Take a new optimizer or model (``state.apply_fn``); once the layout is decided, the
    steps are compiled again for them. The caller starts the new optimizer's state."""
    if optimizer is not None:
        trainer.optimizer = optimizer
    if trainer.state is None:
        if apply_fn is not None:
            trainer._start["apply_fn"] = apply_fn
        return
    if optimizer is not None:
        trainer.state_shardings = trainer.state_shardings.replace(
            opt_state=state_placement.optimizer_shardings(
                trainer.deployer, optimizer, trainer.state.params, trainer.state_shardings.params,
                trainer.trainable))
    if apply_fn is not None:
        trainer.state = trainer.state.replace(apply_fn=apply_fn)
        trainer.state_shardings = trainer.state_shardings.replace(apply_fn=apply_fn)
    trainer.steps = CompiledSteps(trainer)
