"""A trainer's state over its life (``PlacedState``): what it starts from, until the layout is
decided and the state placed, once, at the first batch (``decide_layout``); then replaced
mid-run by ``Trainer.set_train_state`` (new params, optimizer state or step: a FedAvg client,
MAML; Redco 0.4's new optimizer or model). It holds the step's settings (``step_settings.py``)
and the compiled steps made for them (``compiled_steps.py``). The placement itself is
``redco/state_placement.py``'s.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from redco import remat as redco_remat
from redco import state_placement
from redco.compiled_steps import CompiledSteps
from redco.data import check_collated, n_full_batches
from redco.deployer import Deployer
from redco.protocols import LayoutRequest
from redco.sharding import Rules, dataflow_trace
from redco.step_settings import StepSettings
from redco.train_step import TrainState


class PlacedState:
    """``start`` (params, opt_state, apply_fn, step as given) until ``decide_layout``; then
    ``state`` placed by ``shardings`` under ``rules``, and ``steps`` compiled for it."""

    def __init__(self, deployer: Deployer, settings: StepSettings, rules: Rules | None,
                 start: dict):
        self.deployer, self.settings, self.rules, self.start = deployer, settings, rules, start
        self.state: TrainState | None = None
        self.shardings: TrainState | None = None
        self.steps: CompiledSteps | None = None

    def decide_layout(self, collate_fn: Callable, examples: Sequence,
                      per_device_batch_size: int) -> None:
        """At the first batch: the deployer decides the layout (the mesh and the final rules,
        from the loss's dataflow traced on one device's rows unless rules were given; the
        planner's remat policy where the settings have none), then the state is placed, once."""
        if self.state is not None:
            return
        n_full_batches(examples, per_device_batch_size, "train_examples")
        rows = list(examples[:per_device_batch_size])
        batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                             check_collated(collate_fn(rows), len(rows)))
        loss = self._traced_loss()
        n_layers = redco_remat.layers_traced()
        out = jax.eval_shape(loss, self.start["params"], batch)
        state_placement.check_traced_loss(out, self.settings.remat, n_layers,
                                          redco_remat.layers_traced())
        layout = self.deployer.decide_layout(
            self.start["params"], self.rules, trace_fn=dataflow_trace(loss, batch),
            request=LayoutRequest(self.start["params"], loss, batch, self.settings))
        self.rules = layout.rules
        if self.settings.remat is None and layout.remat is not None:  # the planner's
            self.settings = self.settings.replace(remat=redco_remat.check(layout.remat))
            self.deployer.log_info(f"Trainer: remat={self.settings.remat!r}, as planned")
        self._place()

    def _traced_loss(self) -> Callable:
        """``loss(params, batch)``: the step's loss on a fresh state, for tracing."""
        step_loss, apply_fn = self.settings.loss(), self.start["apply_fn"]

        def loss(params, batch):
            state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=None,
                               rng=jax.random.PRNGKey(0), apply_fn=apply_fn)
            return step_loss(params, state, batch, jax.random.PRNGKey(0), True)
        return loss

    def _place(self) -> None:
        start, s = self.start, self.settings
        self.shardings = state_placement.state_shardings(
            self.deployer, start["params"], self.rules, s.optimizer, s.trainable,
            start["apply_fn"])
        self.state = state_placement.initial_state(
            self.deployer, self.shardings, start["params"], start["opt_state"], start["step"],
            s.optimizer, s.trainable)
        self.start = None
        self._compile()

    def _compile(self) -> None:
        self.steps = CompiledSteps(self.settings, self.shardings, self.deployer.mesh,
                                   self.deployer.context_strategy)

    @property
    def apply_fn(self) -> Callable:
        return self.start["apply_fn"] if self.state is None else self.state.apply_fn

    def set(self, params: Any = None, opt_state: Any = None, step: int | None = None) -> None:
        """New ``params`` (a fresh optimizer state unless ``opt_state`` is given), optimizer
        state or step: before the layout is decided, the state to start from."""
        if self.state is None:
            new = {"params": params, "step": step}
            self.start.update({k: v for k, v in new.items() if v is not None})
            if params is not None or opt_state is not None:
                self.start["opt_state"] = opt_state
            return
        s = self.settings
        if params is not None:
            self.state = state_placement.with_params(self.state, self.shardings, params,
                                                     opt_state, s.optimizer, s.trainable)
        elif opt_state is not None:
            self.state = self.state.replace(
                opt_state=state_placement.place_copy(opt_state, self.shardings.opt_state))
        if step is not None:
            self.state = self.state.replace(
                step=state_placement.placed_step(self.deployer, step))

    def replace_optimizer_or_model(self, optimizer=None, apply_fn=None) -> None:
        """Take a new optimizer or model (``state.apply_fn``); once the layout is decided, the
        steps are compiled again for them. The caller starts the new optimizer's state."""
        if optimizer is not None:
            self.settings = self.settings.replace(optimizer=optimizer)
        if self.state is None:
            if apply_fn is not None:
                self.start["apply_fn"] = apply_fn
            return
        if optimizer is not None:
            self.shardings = self.shardings.replace(
                opt_state=state_placement.optimizer_shardings(
                    self.deployer, optimizer, self.state.params, self.shardings.params,
                    self.settings.trainable))
        if apply_fn is not None:
            self.state = self.state.replace(apply_fn=apply_fn)
            self.shardings = self.shardings.replace(apply_fn=apply_fn)
        self._compile()
