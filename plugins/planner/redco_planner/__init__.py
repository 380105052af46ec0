"""``redco-planner``: the layout planner behind ``Deployer(n_model_shards="auto")``, and the
``redco plan`` and ``redco rules`` commands.

Registered through the ``redco`` entry-point group like any third-party plugin:

* ``register_layout_planners``: ``"auto"``, an ``AutoLayoutPlanner``. At ``Trainer.fit``'s first
  batch the Deployer asks it for a layout; it compiles the train step ahead of time for
  ``n_model_shards`` = 1, 2, 4, ... (with ``n_context_shards="auto"``, every mp x cp;
  ``redco_planner.planner.plan``) and returns the first that fits the device memory; for a
  Mixture-of-Experts model, each rule set also with its experts split over ``dp`` (expert
  parallelism, ``auto+ep``, ``auto+fsdp+ep``), so an MoE trains expert-parallel with no flag.
* ``register_commands``: ``"plan"`` and ``"rules"`` (``redco_planner.commands``).

Every ``redco`` process that builds a registry imports this module, so it imports only the
command-line classes; the planner (``planner.py``: the search, ``measure.py``: one layout
compiled, ``layouts.py``: what is reported) and the model inspection (``inspection.py``) are
imported when a layout is planned or a command runs. A run with an integer
``n_model_shards`` never imports them.
"""
from __future__ import annotations

from typing import Any

import redco
from redco.protocols import Layout, LayoutPlanner, LayoutRequest
from redco_planner.commands import PlanCommand, RulesCommand

__all__ = ["AutoLayoutPlanner", "PlanCommand", "RulesCommand"]


class AutoLayoutPlanner(LayoutPlanner):
    """The layout with the fewest devices per example (mp, or mp x cp with context
    parallelism) whose compiled train step fits one device's memory.

    The memory is ``Deployer(device_memory=...)`` (``"40GB"`` or bytes), else what the device
    reports (GPUs and TPUs do; CPUs do not: then the error says to pass it). Each layout
    measured is logged with ``deployer.log_info``; the whole ``redco_planner.planner.Plan``
    (every layout tried and its peak) is the layout's ``report`` (``deployer.layout_plan``).
    """

    def plan(self, deployer: Any, request: LayoutRequest) -> Layout:
        """``request.settings.remat`` None (the Trainer's own is None): try
        ``planner.REMAT_POLICIES``, least recompute first; else plan with that policy alone.
        ``settings.trainable``: the Trainer's mask (LoRA): the frozen leaves are measured without
        gradients or optimizer state. ``settings.accumulate_grad_batches``: micro-batches per
        update, each of ``request.batch``'s rows. ``request.model_degrees``,
        ``context_degrees``: the mp and cp to choose among (None: any), the sequence split the
        deployer's ``context_strategy`` way. The returned layout's ``report`` is the whole
        ``redco_planner.planner.Plan``."""
        from redco_planner import planner
        s = request.settings
        memory = planner.device_memory_bytes(deployer)
        policies = planner.REMAT_POLICIES if s.remat is None else (s.remat,)
        result = planner.plan(request.params, request.loss, request.batch, len(deployer.devices),
                              memory, optimizer=s.optimizer, rule_sets=list(request.rule_sets),
                              log=deployer.log_info, remat_policies=policies,
                              trainable=s.trainable,
                              accumulate_grad_batches=s.accumulate_grad_batches,
                              model_degrees=request.model_degrees,
                              context_degrees=request.context_degrees,
                              context_strategy=deployer.context_strategy)
        deployer.log_info(f"why: {result.reason}")
        return Layout(result.n_model_shards, result.sharding_rules, result.rules, result.remat,
                      result.n_context_shards, report=result)


@redco.hookimpl
def register_layout_planners(register):
    register("auto", AutoLayoutPlanner())


@redco.hookimpl
def register_commands(register):
    register("rules", RulesCommand())
    register("plan", PlanCommand())
