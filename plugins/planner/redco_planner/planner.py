"""Pick a layout that fits: the fewest devices per example whose train step fits in memory.

``plan(params, loss_fn, batch, n_devices, device_memory_bytes)`` tries ``n_model_shards`` =
1, 2, 4, ... (least communication first), at each the rule sets in ``rule_sets`` and, with
each, the rematerialisation policies in ``remat_policies`` (least recompute first, see
``redco.remat``), and picks the first layout whose per-device peak fits in ``1 - HEADROOM``
of the memory. With ``context_degrees`` (context parallelism: ``n_context_shards`` devices
split each sequence), the layouts are ordered by how many devices share one example, mp x cp,
and at the same number tensor parallelism comes first: context parallelism is picked when the
sequence, not the weights, is what does not fit (a sequence's activations shrink ~1/cp; the
weights and optimizer state do not). A model whose attention cannot run over a split sequence
(``redco.sequence_split.SplitNotAsked``) is planned without it. With ``lora_rank``, LoRA
(frozen base, adapters of that rank trained: no gradients or optimizer state for the base) is
tried the same way, only after every full fine-tuning layout failed; with ``trainable`` (a LoRA
``Trainer``'s mask), every layout is measured with only those leaves trained.

The peak is measured, not estimated: the whole train step (forward, backward, optimizer update,
with the state donated as ``Trainer`` does) is compiled ahead of time on abstract shapes,
``jax.jit(step, in_shardings=..., out_shardings=...).lower(...).compile()``, and read off
XLA's ``memory_analysis()``: arguments + outputs - donated aliases + temporaries, so params,
gradients, optimizer state and activations are all in. Nothing is allocated.

``HEADROOM`` (10%) is kept free because the compiled peak is what XLA's buffer assignment
sees, not all the step allocates: the runtime's own buffers, host-side allocations and the
allocator's rounding come on top. On an H100 the real peak was 1.01x the estimate (BENCHMARKS.md
section 4). On CPU (``tests/test_planner_accuracy.py``: the process's RSS peak, glibc handing
every buffer back as it is freed) it was 2 to 8 MiB above the estimate: 1.01x to 1.03x for 38
to 144 MiB per device on 4 or 8 devices, 1.10x for 2 devices of 39 MiB. Serving systems reserve
memory the same way (vLLM uses 90% of a GPU by default). ``plan(..., headroom=0.0)`` plans to
the last byte.

The compile runs on this process's devices; on a CPU, simulate the target's device count with
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` set before jax is imported. The numbers
are then the CPU compiler's buffer assignment, a close but not exact proxy for a GPU's or TPU's.

``AutoLayoutPlanner`` (in ``redco_planner``) runs ``plan`` for ``Deployer(n_model_shards="auto")``
over the deployer's devices and ``device_memory_bytes(deployer)``.
"""
from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from redco import lora as redco_lora
from redco import plugins, sharding
from redco import remat as redco_remat
from redco.sequence_split import SplitNotAsked
from redco.sharding import Rules, dataflow_trace, opt_state_shardings, shardings_from_specs, specs_from_rules
from redco.train_step import TrainState, make_train_step, split, step_loss
from redco_planner.inspection import LoraModel, human_bytes, n_positional, parse_bytes

HEADROOM = 0.1  # the fraction of device memory a plan leaves free; see the module docstring
REMAT_POLICIES = ("none", "dots_saveable", "full")  # least recompute first


def usable_bytes(device_memory_bytes: int, headroom: float = HEADROOM) -> int:
    """The most a layout's compiled per-device peak may be: ``device_memory_bytes`` less the
    ``headroom`` fraction kept for what XLA's buffer assignment does not see."""
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom={headroom!r} must be in [0, 1).")
    return int(device_memory_bytes * (1 - headroom))


def device_memory_bytes(deployer) -> int:
    """``Deployer(device_memory=...)`` in bytes (``"40GB"`` or an int), else the first device's
    ``bytes_limit``; CPUs do not report one, so there it must be given."""
    if deployer.device_memory is not None:
        return parse_bytes(deployer.device_memory)
    device = deployer.devices[0]
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        raise ValueError(
            f"n_model_shards='auto' needs the memory of one device, and {device.platform} "
            "devices do not report it: pass Deployer(device_memory='40GB') (the memory of the "
            "devices you plan for).")
    return int(stats["bytes_limit"])


class PlanError(ValueError):
    """No layout fits the device memory; ``tried`` holds every layout measured."""

    def __init__(self, message: str, tried: list | None = None):
        super().__init__(message)
        self.tried = tried or []


@dataclass
class TriedLayout:
    """One tried layout and what its compiled train step needs per device."""
    sharding_rules: str
    n_model_shards: int
    n_devices: int
    peak_bytes: int | None = None
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0
    temp_bytes: int = 0
    params_bytes: int = 0  # per device, from the shardings alone
    compile_s: float = 0.0
    fits: bool = False
    error: str | None = None  # could not be measured: the exception, type and message
    out_of_memory: str | None = None  # does not fit: XLA's RESOURCE_EXHAUSTED while compiling
    rules: Rules = field(default_factory=list, repr=False)
    remat: str = "none"  # the redco.remat policy the step was compiled under
    flops: float | None = None  # per device: XLA's cost_analysis of the compiled step
    lora_rank: int | None = None  # LoRA adapters' rank (base frozen); None: full fine-tuning
    n_context_shards: int = 1  # cp: devices that split each sequence

    @property
    def mesh_shape(self) -> dict:
        return {"dp": self.n_devices // (self.n_model_shards * self.n_context_shards),
                "cp": self.n_context_shards, "mp": self.n_model_shards}

    def describe(self) -> str:
        cp = f"cp={self.n_context_shards:<3} " if self.n_context_shards > 1 else ""
        name = (f"mp={self.n_model_shards:<3} {cp}dp={self.mesh_shape['dp']:<3} "
                f"{self.sharding_rules:<10}")
        if self.remat != "none":
            name += f" remat={self.remat}"
        if self.lora_rank is not None:
            name += f" lora r={self.lora_rank}"
        if self.error:
            return f"{name} could not be measured: {self.error}"
        if self.out_of_memory:
            return f"{name} does not fit: XLA ran out of memory compiling it ({self.out_of_memory})"
        flops = "" if self.flops is None else f", {self.flops:.3g} FLOPs"
        return (f"{name} peak {human_bytes(self.peak_bytes):>11} (params {human_bytes(self.params_bytes)}, "
                f"temp {human_bytes(self.temp_bytes)}{flops}; compiled in {self.compile_s:.1f}s)"
                f"{'  fits' if self.fits else '  does not fit'}")


@dataclass
class Plan:
    """The pick (``n_model_shards``, ``sharding_rules``, ``rules``) and every layout tried."""
    n_model_shards: int
    sharding_rules: str
    rules: Rules
    peak_bytes: int
    device_memory_bytes: int
    n_devices: int
    tried: list[TriedLayout]
    headroom: float = HEADROOM
    remat: str = "none"
    reason: str = ""  # why this layout: what did not fit before it
    lora_rank: int | None = None  # the pick trains LoRA adapters of this rank (base frozen)
    lora_via: str = ""  # how the LoRA model was built
    n_context_shards: int = 1

    def deployer_kwargs(self) -> dict:
        """``Deployer(**plan.deployer_kwargs(), jax_seed=...)``."""
        return {"n_model_shards": self.n_model_shards, "n_context_shards": self.n_context_shards,
                "sharding_rules": self.sharding_rules}

    def __str__(self) -> str:
        usable = usable_bytes(self.device_memory_bytes, self.headroom)
        lines = [f"device memory {human_bytes(self.device_memory_bytes)} x {self.n_devices} devices; "
                 f"a layout fits if its peak is at most {human_bytes(usable)} "
                 f"({self.headroom:.0%} kept as headroom)"]
        lines += ["  " + layout.describe() for layout in self.tried]
        lines.append(f"pick: n_model_shards={self.n_model_shards}, "
                     f"n_context_shards={self.n_context_shards}, "
                     f"sharding_rules={self.sharding_rules!r}, remat={self.remat!r}"
                     f"{'' if self.lora_rank is None else f', LoRA rank {self.lora_rank}'}, peak "
                     f"{human_bytes(self.peak_bytes)} per device "
                     f"({100 * self.peak_bytes / self.device_memory_bytes:.0f}% of memory)")
        lines.append(f"why: {self.reason}")
        return "\n".join(lines)


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
            compute_dtype: Any = None) -> TriedLayout:
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
    """
    optimizer = as_optimizer(optimizer)
    layout = TriedLayout(sharding_rules, n_model_shards, n_devices,
                         remat=redco_remat.check(remat), n_context_shards=n_context_shards)
    mesh = make_mesh(n_devices, n_model_shards, n_context_shards)
    dp = mesh.shape["dp"]
    batch = micro_batches(global_batch(batch_abstract, dp), accumulate_grad_batches)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # indivisible params replicate, as in training
        layout.rules = (list(rules) if rules is not None else
                        layout_rules(params_abstract, mesh, sharding_rules, trace_fn))
        specs = specs_from_rules(params_abstract, layout.rules, mesh)
    params_shardings = shardings_from_specs(specs, mesh)
    replicated = NamedSharding(mesh, P())
    trained = split(params_abstract, trainable)[0]
    state = train_state(params_abstract, jax.eval_shape(optimizer.init, trained))
    state_shardings = train_state(params_shardings, opt_state_shardings(
        optimizer, trained, split(params_shardings, trainable)[0], mesh)).replace(
            step=replicated, rng=replicated)
    batch_shardings = jax.tree.map(lambda x: NamedSharding(mesh, P(None, "dp")), batch)
    layout.params_bytes = sum(
        math.prod(s.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
        for x, s in zip(jax.tree.leaves(params_abstract), jax.tree.leaves(params_shardings)))
    step = make_train_step(step_loss(lambda rng, state, params, batch, is_training: loss(params, batch),
                                     params_shardings, compute_dtype, mesh=mesh,
                                     context_strategy=context_strategy),
                           optimizer, trainable, accumulate_grad_batches)
    start = time.perf_counter()
    with redco_remat.policy(remat):
        compiled = jax.jit(step, in_shardings=(state_shardings, batch_shardings),
                           out_shardings=(state_shardings, replicated),
                           donate_argnums=0).lower(state, batch).compile()
    layout.compile_s = time.perf_counter() - start
    layout.flops = step_flops(compiled)
    stats = compiled.memory_analysis()
    layout.argument_bytes = stats.argument_size_in_bytes
    layout.output_bytes = stats.output_size_in_bytes
    layout.alias_bytes = stats.alias_size_in_bytes
    layout.temp_bytes = stats.temp_size_in_bytes
    layout.peak_bytes = (stats.argument_size_in_bytes + stats.output_size_in_bytes
                         - stats.alias_size_in_bytes + stats.temp_size_in_bytes)
    return layout


def step_flops(compiled) -> float | None:
    """The compiled step's FLOPs per device (``cost_analysis()["flops"]``), None if not given."""
    flops = (compiled.cost_analysis() or {}).get("flops")
    return None if flops is None else float(flops)


def model_shard_degrees(n_devices: int) -> list[int]:
    """1, 2, 4, ... up to ``n_devices``, then any other divisor, smallest first."""
    divisors = [d for d in range(1, n_devices + 1) if n_devices % d == 0]
    powers = [d for d in divisors if d & (d - 1) == 0]
    return powers + [d for d in divisors if d not in powers]


def split_degrees(n_devices: int, model_degrees: Sequence[int] | None = None,
                  context_degrees: Sequence[int] | None = (1,)) -> list[tuple[int, int]]:
    """The ``(mp, cp)`` pairs to try (None: every degree), in order: fewest devices per example
    (mp x cp, in ``model_shard_degrees`` order) first, and at the same number, tensor before
    context parallelism (it also shards the weights; context parallelism only activations)."""
    order = model_shard_degrees(n_devices)
    pairs = [(mp, cp) for mp in (model_degrees or order) for cp in (context_degrees or order)
             if n_devices % (mp * cp) == 0]
    return sorted(pairs, key=lambda pair: (order.index(pair[0] * pair[1]), pair[1]))


def plan(params_abstract, loss_or_trace_fn: Callable, batch_abstract, n_devices: int,
         device_memory_bytes: int, optimizer: Any = optax.adamw,
         rule_sets: Sequence[str] = ("auto", "auto+fsdp"), trace_fn: Callable | None = None,
         try_all: bool = False, log: Callable[[str], None] | None = None,
         headroom: float = HEADROOM, remat_policies: Sequence[str] = ("none",),
         lora_rank: int | None = None,
         lora: Callable[[int], LoraModel] | None = None, trainable: Any = None,
         accumulate_grad_batches: int = 1, model_degrees: Sequence[int] | None = None,
         context_degrees: Sequence[int] | None = (1,),
         context_strategy: str = "all_gather") -> Plan:
    """The layout with the fewest devices per example whose train step fits
    ``device_memory_bytes``.

    Args:
      params_abstract: the params, ``jax.ShapeDtypeStruct`` leaves (``jax.eval_shape``) or real.
      loss_or_trace_fn: ``loss(params, batch) -> scalar``, or ``trace_fn(params) -> outputs``
        (then its outputs' mean stands for the loss and ``batch_abstract`` may be None).
      batch_abstract: one device's batch (``per_device_batch_size`` rows), abstract.
      n_devices: devices to plan for (this process must see at least as many).
      device_memory_bytes: memory per device.
      optimizer: an optax optimizer or factory (``optax.adamw``); its state is counted.
      rule_sets: rule-set names tried at every ``n_model_shards``, in order.
      trace_fn: for the ``auto`` rules' dataflow; by default the loss on the batch shapes.
      try_all: compile every layout instead of stopping at the first that fits.
      log: called with a line per layout as it is measured (e.g. ``print``).
      headroom: the fraction of ``device_memory_bytes`` left free: a layout fits when its
        peak is at most ``usable_bytes(device_memory_bytes, headroom)``. The default,
        ``HEADROOM`` = 0.1, covers what the compiled peak does not count (module docstring).
      remat_policies: ``redco.remat`` policies tried with each layout, least recompute first,
        e.g. ``REMAT_POLICIES``; only ``"none"`` if the loss runs no ``redco.remat.layer``.
      lora_rank: also try LoRA of this rank (base frozen), only once no full fine-tuning
        layout fits.
      lora: ``rank -> LoraModel`` (e.g. a model with native LoRA layers); by default
        ``redco.lora.add_adapters`` on the params, merged into the kernels in the loss.
      trainable: a mask as ``Trainer(trainable=...)`` takes (e.g. ``redco.lora.trainable_mask``
        of params that already hold adapters): only those leaves get gradients and optimizer
        state in every layout measured.
      accumulate_grad_batches: micro-batches per update (``batch_abstract`` rows each), summed
        in one step as ``Trainer`` does.
      model_degrees: the ``n_model_shards`` to try; None: every divisor of ``n_devices``.
      context_degrees: the ``n_context_shards`` to try (None: every divisor), each sequence
        split ``context_strategy``'s way; the default, 1, splits none.

    Raises:
      PlanError: nothing fits; the message names the smallest peak found.
    """
    known = plugins.registry("sharding_rules")
    unknown = [name for name in rule_sets if name not in known]
    if unknown:
        raise ValueError(f"Unknown rule sets {unknown}: known are {sorted(known)}.")
    usable = usable_bytes(device_memory_bytes, headroom)
    loss = as_loss(loss_or_trace_fn)
    if trace_fn is None and n_positional(loss_or_trace_fn) >= 2:
        trace_fn = dataflow_trace(loss, batch_abstract)
    elif trace_fn is None:
        trace_fn = loss_or_trace_fn
    params_abstract = abstract(params_abstract)
    policies = effective_policies(remat_policies, loss, params_abstract, batch_abstract)
    degrees = split_degrees(n_devices, model_degrees, context_degrees)
    if not degrees:
        raise ValueError(f"No n_model_shards in {model_degrees} and n_context_shards in "
                         f"{context_degrees} together divide {n_devices} devices.")
    candidates = [(mp, cp, name, policy) for mp, cp in degrees
                  for name in rule_sets for policy in policies]
    splits_sequence = True  # False once the model is found not to split the sequence

    def search(params, loss, trace_fn, trainable=None, rank=None) -> TriedLayout | None:
        nonlocal splits_sequence
        pick = None
        for mp, cp, name, policy in candidates:
            if cp > 1 and not splits_sequence:
                continue
            try:
                layout = try_layout(params, loss, batch_abstract, n_devices, mp, name, optimizer,
                                    trace_fn, policy, trainable, usable, accumulate_grad_batches,
                                    cp, context_strategy)
            except SplitNotAsked:
                splits_sequence = False
                if log:
                    log("n_context_shards > 1 not tried: the model's attention cannot run over "
                        "a split sequence (it never asks redco.sequence_split how)")
                continue
            layout.lora_rank = rank
            tried.append(layout)
            if log:
                log(layout.describe())
            if layout.fits and pick is None:
                pick = layout
                if not try_all:
                    break
        return pick

    tried: list[TriedLayout] = []
    pick, adapters = search(params_abstract, loss, trace_fn, trainable), None
    if lora_rank is not None and (pick is None or try_all):
        adapters = (lora or generic_lora(params_abstract, loss))(lora_rank)
        lora_pick = search(abstract(adapters.params), adapters.loss,
                           dataflow_trace(adapters.loss, batch_abstract),
                           redco_lora.trainable_mask(adapters.params), lora_rank)
        pick = pick or lora_pick
    if not tried and not splits_sequence:
        raise PlanError(f"Every layout asked for splits the sequence (n_context_shards in "
                        f"{context_degrees}), but the model's attention cannot run over a split "
                        "sequence: use a zoo LLaMA-family or GPT-2 model, or n_context_shards=1.")
    if pick is None:
        raise nothing_fits(tried, n_devices, device_memory_bytes, headroom)
    result = Plan(pick.n_model_shards, pick.sharding_rules, pick.rules, pick.peak_bytes,
                  device_memory_bytes, n_devices, tried, headroom, pick.remat, "",
                  pick.lora_rank, adapters.via if adapters and pick.lora_rank else "",
                  pick.n_context_shards)
    result.reason = why(pick, tried, result.lora_via)
    return result


def abstract(params):
    """``params`` as ``jax.ShapeDtypeStruct`` leaves."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)


def try_layout(params, loss, batch, n_devices, mp, name, optimizer, trace_fn, policy,
               trainable, usable, accumulate_grad_batches: int = 1, cp: int = 1,
               context_strategy: str = "all_gather") -> TriedLayout:
    """``measure``, with ``fits`` set. A layout XLA runs out of memory compiling does not fit;
    one that fails for any other reason could not be measured, and keeps the exception."""
    try:
        layout = measure(params, loss, batch, n_devices, mp, name, optimizer, trace_fn,
                         remat=policy, trainable=trainable,
                         accumulate_grad_batches=accumulate_grad_batches,
                         n_context_shards=cp, context_strategy=context_strategy)
        layout.fits = layout.peak_bytes <= usable
    except SplitNotAsked:
        raise  # the model, not this layout: the caller stops trying context parallelism
    except Exception as e:  # noqa: BLE001 - reported with the layout, type and message
        failure = f"{type(e).__name__}: {e}"[:800]
        layout = TriedLayout(name, mp, n_devices, remat=policy, n_context_shards=cp)
        if isinstance(e, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(e):
            layout.out_of_memory = failure
        else:
            layout.error = failure
    return layout


def generic_lora(params_abstract, loss: Callable, alpha: float = 16.0) -> Callable[[int], LoraModel]:
    """``rank -> LoraModel``: ``redco.lora.add_adapters`` on the default targets, the loss
    on the params with the adapters merged in (a full-size merged kernel per layer)."""
    def build(rank: int) -> LoraModel:
        params = jax.eval_shape(lambda p: redco_lora.add_adapters(p, rank), params_abstract)
        return LoraModel(params, lambda p, b: loss(redco_lora.merge(p, alpha), b),
                         "redco.lora.add_adapters, merged into the kernels in the loss")
    return build


def nothing_fits(tried: list[TriedLayout], n_devices: int, device_memory_bytes: int,
                 headroom: float) -> PlanError:
    """The error when no layout fits: the smallest peak found, or why none compiled."""
    measured = [t for t in tried if t.peak_bytes is not None]
    if not measured:
        return PlanError(f"No layout was found for {n_devices} devices: "
                         + "; ".join(t.describe() for t in tried), tried)
    unmeasured = "; ".join(t.describe() for t in tried if t.error)
    usable = usable_bytes(device_memory_bytes, headroom)
    best = min(measured, key=lambda t: t.peak_bytes)
    return PlanError(
        f"No layout fits {human_bytes(device_memory_bytes)} per device on {n_devices} "
        f"devices, less the {headroom:.0%} headroom (at most {human_bytes(usable)} per "
        f"device, {usable} bytes): the smallest per-device peak found is {human_bytes(best.peak_bytes)} "
        f"({best.peak_bytes} bytes, n_model_shards={best.n_model_shards}, "
        f"sharding_rules={best.sharding_rules!r}). Use more devices or more memory per "
        "device, a smaller batch or sequence, or a smaller model."
        + (f" Not compared, since not measured: {unmeasured}" if unmeasured else ""), tried)


def effective_policies(policies: Sequence[str], loss: Callable, params_abstract,
                       batch_abstract) -> list[str]:
    """``policies`` (checked, in order), or only ``"none"`` when tracing ``loss`` under a
    policy runs no ``redco.remat.layer`` (every policy would compile the same step)."""
    policies = [redco_remat.check(name) for name in policies]
    if not policies:
        raise ValueError("remat_policies is empty: give at least one, e.g. ('none',).")
    others = [name for name in policies if name != "none"]
    if not others:
        return policies
    before = redco_remat.layers_traced()
    with redco_remat.policy(others[0]):  # a fresh function: a cached trace would count none
        jax.eval_shape(lambda p, b: loss(p, b), params_abstract, batch_abstract)
    return policies if redco_remat.layers_traced() > before else policies[:1]


def split_name(layout: TriedLayout) -> str:
    """``mp=2``, or ``mp=2 cp=4`` for a layout that splits the sequence."""
    cp = layout.n_context_shards
    return f"mp={layout.n_model_shards}" + (f" cp={cp}" if cp > 1 else "")


def why(pick: TriedLayout, tried: list[TriedLayout], lora_via: str = "") -> str:
    """Why ``pick``: the layouts with fewer devices per example (smaller mp, or mp x cp), and
    the lighter policies at its own, that did not fit (and, for LoRA, that no full fine-tuning
    layout did)."""
    same_kind = [t for t in tried if t.lora_rank == pick.lora_rank]
    at_pick = lambda t: (t.n_model_shards, t.n_context_shards) == (pick.n_model_shards,
                                                                   pick.n_context_shards)
    below = [t for t in same_kind[:same_kind.index(pick)] if not at_pick(t)]
    context = any(t.n_context_shards > 1 for t in below + [pick])
    reason = "the fewest devices per example (mp x cp) that fit" if context else \
        "the smallest mp that fits"
    if below:
        smaller = (", ".join(dict.fromkeys(map(split_name, below))) if context else
                   "mp=" + ", ".join(map(str, sorted({t.n_model_shards for t in below}))))
        unmeasured = sum(1 for t in below if t.error)
        reason += (f" (nothing tried at {smaller} fits)" if not unmeasured else
                   f" (nothing measured at {smaller} fits; {unmeasured} could not be measured)")
    if pick.lora_rank is not None:
        reason = (f"no full fine-tuning layout fits; with LoRA rank {pick.lora_rank} "
                  f"({lora_via}), {reason}")
    if pick.remat == "none":
        return f"{reason}; at {split_name(pick)} it fits without remat"
    lighter = [t.remat for t in same_kind[:same_kind.index(pick)]
               if at_pick(t) and t.sharding_rules == pick.sharding_rules and t.remat != pick.remat]
    return (f"{reason}; at {split_name(pick)} {pick.sharding_rules} fits only with "
            f"remat={pick.remat} (not with {', '.join(lighter)})")
