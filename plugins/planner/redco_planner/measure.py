"""Measure one layout: compile ``Trainer``'s own train step ahead of time on abstract shapes,
sharded as that layout shards it, and read the per-device memory (arguments + outputs - donated
aliases + temporaries, from XLA's ``memory_analysis()``) and FLOPs off the compiled executable.
Nothing is allocated.

The FLOPs are XLA's ``cost_analysis()`` of the compiled step, which counts a loop's body once,
plus what that leaves out of the step's scans (``redco.step_flops.loop_repeats_flops``: a
scanned layer stack's other layers, gradient accumulation's other micro-batches), counted from
the traced step and split evenly over the devices: the FLOPs of one whole update.

A layout whose state alone (params and optimizer state, per device, from the shardings) is over
``skip_above`` bytes is not compiled: the peak counts the arguments, so it cannot be lower. The
planner passes its usable bytes, which spares it the longest compiles (every layout that
replicates a model too big for one device)."""
from __future__ import annotations

import math
import time
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from redco import plugins, sharding
from redco import remat as redco_remat
from redco.hlo_collectives import collectives
from redco.sharding import Rules, opt_state_shardings, shardings_from_specs, specs_from_rules
from redco.step_flops import loop_repeats_flops
from redco.train_step import TrainState, compiler_options, make_train_step, split, step_loss
from redco_planner.layouts import TriedLayout
from redco_planner.models import n_positional


def make_mesh(n_devices: int, n_model_shards: int, n_context_shards: int = 1):
    """The ``('dp', 'mp')`` (or ``('dp', 'cp', 'mp')``) mesh ``Deployer`` builds, over the
    first ``n_devices`` devices."""
    devices = jax.devices()
    if n_devices > len(devices):
        raise ValueError(
            f"Planning for {n_devices} devices needs as many here, but jax sees {len(devices)}. "
            f"On a CPU set XLA_FLAGS=--xla_force_host_platform_device_count={n_devices} before "
            "jax is imported (the redco CLI does this for you).")
    return sharding.make_mesh(devices[:n_devices], n_model_shards, n_context_shards)


def as_optimizer(optimizer) -> optax.GradientTransformation:
    """An optax optimizer, or a factory such as ``optax.adamw`` (called with a learning rate)."""
    if isinstance(optimizer, optax.GradientTransformation):
        return optimizer
    return optimizer(1e-3)


def as_loss(loss_or_trace_fn: Callable) -> Callable:
    """``loss(params, batch) -> scalar``; a ``trace_fn(params) -> outputs`` becomes the sum of
    the means of its floating outputs (its example input is fixed inside it; ``batch`` unused)."""
    if n_positional(loss_or_trace_fn) >= 2:
        return loss_or_trace_fn

    def loss(params, batch):
        outs = [x for x in jax.tree.leaves(loss_or_trace_fn(params))
                if jnp.issubdtype(x.dtype, jnp.floating)]
        return sum(jnp.mean(x.astype(jnp.float32)) for x in outs)
    return loss


def global_batch(batch_abstract, dp: int):
    """One device's batch (``per_device_batch_size`` rows, redco's convention) -> the global
    batch of ``dp`` times as many rows, split over ``dp``."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0] * dp,) + tuple(x.shape[1:]),
                                                       x.dtype), batch_abstract)


def train_state(params, opt_state, apply_fn: Callable | None = None) -> TrainState:
    """A ``TrainState`` of ``params`` and ``opt_state`` at step 0 (abstract where they are)."""
    return TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params,
                      opt_state=opt_state, rng=jax.eval_shape(lambda: jax.random.PRNGKey(0)),
                      apply_fn=apply_fn)


def micro_batches(batch_abstract, k: int):
    """The batch as the step takes it: ``k`` micro-batches of it on a leading axis."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((k,) + tuple(x.shape), x.dtype),
                        batch_abstract)


def layout_rules(params_abstract, mesh, sharding_rules: str, trace_fn: Callable | None) -> Rules:
    """What ``deployer.get_sharding_rules(params, trace_fn=trace_fn)`` returns on ``mesh``."""
    return plugins.lookup("sharding_rules", sharding_rules)(params_abstract, mesh, trace_fn)


def measure(params_abstract, loss: Callable, batch_abstract, n_devices: int,
            n_model_shards: int, sharding_rules: str = "auto",
            optimizer: Any = optax.adamw, trace_fn: Callable | None = None,
            rules: Rules | None = None, remat: str = "none",
            trainable: Any = None, accumulate_grad_batches: int = 1,
            n_context_shards: int = 1, context_strategy: str = "all_gather",
            compute_dtype: Any = None, skip_above: int | None = None,
            overrides: Callable[[Rules], Rules] | None = None) -> TriedLayout:
    """Compile one train step ahead of time on abstract shapes; read its per-device memory and
    FLOPs.

    ``batch_abstract`` holds one device's rows (the global batch is ``dp`` times that).
    ``rules`` (if given) replaces the rule set's. The step is traced under ``redco.remat``
    policy ``remat`` (a loss that sets its own, as ``Trainer(remat=...)`` does, keeps that).
    ``trainable`` (a mask like ``redco.lora.trainable_mask``): only those leaves get gradients
    and optimizer state, as with ``Trainer(trainable=...)``. The step is ``Trainer``'s own
    (``redco.train_step.make_train_step``), over ``accumulate_grad_batches`` micro-batches,
    with the sequence split over ``n_context_shards`` devices as ``Trainer`` splits it, and
    the params cast to ``compute_dtype`` (e.g. ``jnp.bfloat16``) as ``Trainer`` casts them.
    With ``skip_above``, a layout whose params and optimizer state alone are over that many
    bytes per device is returned uncompiled (``layout.over_budget`` says why).
    ``overrides(rules by name) -> rules`` (a quantised base's parts, ``LoraModel.overrides``)
    are checked before the rule set's, given the rule set's rules by name on this mesh.
    """
    optimizer = as_optimizer(optimizer)
    layout = TriedLayout(sharding_rules, n_model_shards, n_devices,
                         remat=redco_remat.check(remat), n_context_shards=n_context_shards)
    mesh = make_mesh(n_devices, n_model_shards, n_context_shards)
    batch = micro_batches(global_batch(batch_abstract, mesh.shape["dp"]), accumulate_grad_batches)
    params_shardings = shard_params(layout, params_abstract, mesh, trace_fn, rules, overrides)
    layout.params_bytes = per_device_bytes(params_abstract, params_shardings)
    state, state_shardings = abstract_state(params_abstract, params_shardings, optimizer,
                                            trainable, mesh)
    layout.state_bytes = per_device_bytes(state, state_shardings)
    if skip_above is not None and layout.state_bytes > skip_above:
        layout.over_budget = skip_above
        return layout
    step = make_train_step(step_loss(lambda rng, state, params, batch, is_training: loss(params, batch),
                                     params_shardings, compute_dtype, mesh=mesh,
                                     context_strategy=context_strategy),
                           optimizer, trainable, accumulate_grad_batches)
    compile_step(layout, step, state, state_shardings, batch, mesh, remat)
    check_expert_parallel(layout, mesh)
    return layout


def shard_params(layout: TriedLayout, params_abstract, mesh, trace_fn: Callable | None,
                 rules: Rules | None, overrides: Callable[[Rules], Rules] | None):
    """The params' shardings on ``mesh``, by ``rules`` or else the layout's rule set's, after
    ``overrides``' (as ``measure`` takes them), into ``layout.rules``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # indivisible params replicate, as in training
        layout.rules = (list(rules) if rules is not None else
                        layout_rules(params_abstract, mesh, layout.sharding_rules, trace_fn))
        if overrides is not None:
            layout.rules = overrides(layout_rules(params_abstract, mesh, layout.sharding_rules,
                                                  None)) + layout.rules
        specs = specs_from_rules(params_abstract, layout.rules, mesh)
    return shardings_from_specs(specs, mesh)


def compile_step(layout: TriedLayout, step: Callable, state, state_shardings, batch, mesh,
                 remat: str) -> None:
    """Compile ``step`` under ``redco.remat`` policy ``remat``; its compile time, memory, FLOPs
    (with its loops' repeats, per device) and collectives into ``layout``."""
    start = time.perf_counter()
    with redco_remat.policy(remat):
        traced = trace_step(step, state, state_shardings, batch, mesh)
        compiled = traced.lower().compile()
    layout.compile_s = time.perf_counter() - start
    read_memory(layout, compiled)
    if layout.flops is not None:
        layout.flops += loop_repeats_flops(traced) / layout.n_devices
    layout.collectives = collectives(compiled.as_text())


def check_expert_parallel(layout: TriedLayout, mesh) -> None:
    """Refuse a layout that splits the experts whose compiled step never sends tokens to them."""
    if layout.n_expert_shards > 1 and "all-to-all" not in layout.collectives:
        raise ValueError(f"{layout.sharding_rules} splits the experts over "
                         f"dp={mesh.shape['dp']}, but the compiled step has no all-to-all: the "
                         "model's MoE blocks do not run expert-parallel (they never read "
                         "redco.fsdp.declared; the zoo's do, redco_zoo_models.expert_parallel).")


def abstract_state(params_abstract, params_shardings, optimizer, trainable, mesh):
    """The abstract ``TrainState`` ``Trainer`` keeps (params, and the optimizer state of the
    ``trainable`` part) and its shardings: the optimizer state sharded like its params."""
    replicated = NamedSharding(mesh, P())
    trained = split(params_abstract, trainable)[0]
    state = train_state(params_abstract, jax.eval_shape(optimizer.init, trained))
    state_shardings = train_state(params_shardings, opt_state_shardings(
        optimizer, trained, split(params_shardings, trainable)[0], mesh)).replace(
            step=replicated, rng=replicated)
    return state, state_shardings


def per_device_bytes(tree, shardings) -> int:
    """The bytes one device holds of ``tree`` (abstract leaves) sharded by ``shardings``."""
    return sum(math.prod(s.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
               for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)))


def trace_step(step: Callable, state, state_shardings, batch, mesh) -> jax.stages.Traced:
    """``step`` traced on abstract shapes as ``Trainer`` runs it (``.lower().compile()``
    compiles it): the state sharded by ``state_shardings`` and donated, the micro-batches
    split over ``dp``."""
    replicated = NamedSharding(mesh, P())
    batch_shardings = jax.tree.map(lambda x: NamedSharding(mesh, P(None, "dp")), batch)
    return jax.jit(step, in_shardings=(state_shardings, batch_shardings),
                   out_shardings=(state_shardings, replicated), donate_argnums=0,
                   compiler_options=compiler_options()).trace(state, batch)


def read_memory(layout: TriedLayout, compiled) -> None:
    """The compiled step's per-device bytes, XLA's FLOPs and bytes accessed, into ``layout``:
    its peak is arguments + outputs - donated aliases + temporaries."""
    layout.flops = step_flops(compiled)
    layout.bytes_accessed = (compiled.cost_analysis() or {}).get("bytes accessed")
    stats = compiled.memory_analysis()
    layout.argument_bytes = stats.argument_size_in_bytes
    layout.output_bytes = stats.output_size_in_bytes
    layout.alias_bytes = stats.alias_size_in_bytes
    layout.temp_bytes = stats.temp_size_in_bytes
    layout.peak_bytes = (stats.argument_size_in_bytes + stats.output_size_in_bytes
                         - stats.alias_size_in_bytes + stats.temp_size_in_bytes)


def step_flops(compiled) -> float | None:
    """The compiled step's FLOPs per device (``cost_analysis()["flops"]``), None if not given."""
    flops = (compiled.cost_analysis() or {}).get("flops")
    return None if flops is None else float(flops)


def abstract(params):
    """``params`` as ``jax.ShapeDtypeStruct`` leaves."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
