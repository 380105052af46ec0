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
``Trainer``'s mask), every layout is measured with only those leaves trained. With
``quantize_base`` (``auto``, ``int8``, ``nf4``, ``fp8``) and ``lora_rank``, LoRA over a
quantised base comes last, once neither fits (``redco_planner.qlora``): ``auto`` tries int8,
then nf4.

**Expert parallelism.** For a Mixture-of-Experts model (stacked ``experts/...`` weights,
``redco.builtins.rules.has_experts``) each rule set comes with its expert-parallel variant
(``+ep``: the experts split over ``dp``, tokens sent to them by ``all_to_all``; EP degree = dp,
so it costs no device per example), at the same mp and cp, in this order: ``auto``,
``auto+ep``, ``auto+fsdp+ep``, ``auto+fsdp``. The rule is the fewest bytes moved inside the
layers first. ``auto`` replicates the experts and moves nothing in the layer (its gradient
all-reduce overlaps the backward pass; an all_to_all sits on the layer's critical path and
waits for the most loaded device). ``auto+ep`` keeps each device's share of the experts
(1/dp of their weights, gradients and AdamW state) and moves tokens: per MoE layer and step,
4 all_to_alls (2 forward, 2 backward) of an (E, C, H) buffer per device, n tokens per device,
``C = ceil(cf * n * k / E)`` with a capacity factor cf, ``C = n`` dropless (this EP pads every
(source, expert) pair to n rows: ``redco_zoo_models.expert_parallel``). ``auto+fsdp+ep`` also
splits the rest over dp. ``auto+fsdp`` last: it all-gathers every layer's experts (forward and
backward) and reduce-scatters their gradients, ``3 * 3 * E * H * I`` elements per MoE layer.
With cf = 1.25 that is several times the tokens' ``4 * E * C * H`` (Qwen3-30B-A3B at 4,096
tokens per device: 5.4x); dropless, E/k times more tokens move and the order can be the wrong
way round (Qwen3-30B-A3B: 0.42x), which ``bench/moe_plans.py`` measures. The capacity factor
is the model's own (``MoEConfig.capacity_factor``, dropless by default): the planner does not
choose it, because a factor drops tokens, i.e. changes what the step computes, which no
layout the planner picks does (LoRA, the one exception, is asked for with ``lora_rank``).

The peak is measured, not estimated (``redco_planner.measure``): the whole train step
(forward, backward, optimizer update, with the state donated as ``Trainer`` does) is compiled
ahead of time on abstract shapes,
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

from typing import Any, Callable, Sequence

import jax
import optax

from redco import lora as redco_lora
from redco import plugins
from redco import remat as redco_remat
from redco.builtins.rules import has_experts
from redco.sharding import dataflow_trace
from redco_planner import qlora
from redco_planner.inspection import parse_bytes
from redco_planner.layouts import HEADROOM, Plan, PlanError, nothing_fits, usable_bytes, why
from redco_planner.measure import abstract, as_loss
from redco_planner.models import LoraModel, n_positional
from redco_planner.search import Search

REMAT_POLICIES = ("none", "dots_saveable", "full")  # least recompute first
# In a scanned body "none" keeps what redco.remat.SCANNED_NONE keeps; these keep at least as
# much there, so beside "none" a stack of scanned layers does not try them (effective_policies).
SCANNED_REDUNDANT = frozenset({"dots_saveable", redco_remat.SCANNED_NONE})
# a rule set -> it and its expert-parallel variant, in the order tried (module docstring)
EXPERT_PARALLEL = {"auto": ("auto", "auto+ep"), "auto+fsdp": ("auto+fsdp+ep", "auto+fsdp")}


def device_memory_bytes(deployer) -> int:
    """``Deployer(device_memory=...)`` in bytes (``"40GB"`` or an int), else the first device's
    ``bytes_limit``; CPUs do not report one, so there it must be given."""
    return memory_bytes(deployer.device_memory, deployer.devices[0])


def memory_bytes(device_memory: str | int | None, device) -> int:
    """``device_memory`` in bytes (``"40GB"`` or an int), else ``device``'s ``bytes_limit``."""
    if device_memory is not None:
        return parse_bytes(device_memory)
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        raise ValueError(
            f"n_model_shards='auto' needs the memory of one device, and {device.platform} "
            "devices do not report it: pass Deployer(device_memory='40GB') (the memory of the "
            "devices you plan for).")
    return int(stats["bytes_limit"])


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
         context_strategy: str = "all_gather", compute_dtype: Any = None,
         expert_parallel: bool = True, quantize_base: str | None = None,
         quantized: Callable[[int, str], LoraModel] | None = None) -> Plan:
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
      rule_sets: rule-set names tried at every ``n_model_shards``, in order; for a model with
        experts, ``auto`` and ``auto+fsdp`` each with its expert-parallel variant
        (``EXPERT_PARALLEL``).
      trace_fn: for the ``auto`` rules' dataflow; by default the loss on the batch shapes.
      try_all: compile every layout instead of stopping at the first that fits. Without it, a
        layout whose params and optimizer state alone are over the usable memory is reported
        as not fitting without being compiled (its peak can only be higher).
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
        state in every layout measured. With ``lora_rank`` too, the params are taken to hold
        adapters of that rank (no LoRA is added; only ``quantize_base`` is tried after them).
      quantize_base: ``auto``, ``int8``, ``nf4`` or ``fp8`` (needs ``lora_rank``): once no
        layout fits without it, try LoRA over the base quantised (``redco_planner.qlora``),
        ``auto`` int8 then nf4, each built by ``quantized(rank, format)`` (a ``LoraModel`` with
        its parts' ``overrides``; ``Model.quantized`` of the zoo's decoders).
      accumulate_grad_batches: micro-batches per update (``batch_abstract`` rows each), summed
        in one step as ``Trainer`` does.
      model_degrees: the ``n_model_shards`` to try; None: every divisor of ``n_devices``.
      context_degrees: the ``n_context_shards`` to try (None: every divisor), each sequence
        split ``context_strategy``'s way; the default, 1, splits none.
      expert_parallel: for a model with experts, also try each rule set's expert-parallel
        variant (module docstring); False: only ``rule_sets``.
      compute_dtype: the dtype the step computes in (e.g. ``jnp.bfloat16``), the params cast
        to it as ``Trainer(compute_dtype=...)`` casts them; None: the params' own (fp32). The
        params and optimizer state stay in theirs.

    Raises:
      PlanError: nothing fits; the message names the smallest peak found.
    """
    qlora.check(quantize_base, lora_rank, quantized)
    check_rule_sets(rule_sets)
    bases = qlora.quantized_bases(quantized, lora_rank, quantize_base, log or (lambda _: None)) \
        if quantize_base else {}
    loss = as_loss(loss_or_trace_fn)
    if trace_fn is None:
        trace_fn = default_trace_fn(loss_or_trace_fn, loss, batch_abstract)
    params_abstract = abstract(params_abstract)
    if expert_parallel:
        rule_sets = with_expert_parallel(rule_sets, params_abstract)
    degrees = checked_split_degrees(n_devices, model_degrees, context_degrees)
    policies = effective_policies(remat_policies, loss, params_abstract, batch_abstract)
    search = Search([(mp, cp, name, policy) for mp, cp in degrees for name in rule_sets
                     for policy in policies],
                    dict(batch=batch_abstract, n_devices=n_devices, optimizer=optimizer,
                         usable=usable_bytes(device_memory_bytes, headroom),
                         accumulate_grad_batches=accumulate_grad_batches,
                         context_strategy=context_strategy, compute_dtype=compute_dtype),
                    try_all, log)
    pick = search.run(params_abstract, loss, trace_fn, trainable,
                      lora_rank if trainable is not None else None)
    pick, vias = search_lora_models(search, pick, lora_models(
        params_abstract, loss, lora_rank, lora, trainable, bases), batch_abstract, lora_rank)
    check_sequence_split(search, context_degrees)
    if pick is None:
        raise nothing_fits(search.tried, n_devices, device_memory_bytes, headroom)
    return as_plan(pick, search.tried, vias, device_memory_bytes, n_devices, headroom)


def check_rule_sets(rule_sets: Sequence[str]) -> None:
    """Refuse rule-set names no plugin registers (``sharding_rules``)."""
    known = plugins.registry("sharding_rules")
    unknown = [name for name in rule_sets if name not in known]
    if unknown:
        raise ValueError(f"Unknown rule sets {unknown}: known are {sorted(known)}.")


def default_trace_fn(loss_or_trace_fn: Callable, loss: Callable, batch_abstract) -> Callable:
    """The ``auto`` rules' dataflow: the loss traced on the batch's shapes, or the given
    ``trace_fn(params)`` itself."""
    if n_positional(loss_or_trace_fn) >= 2:
        return dataflow_trace(loss, batch_abstract)
    return loss_or_trace_fn


def checked_split_degrees(n_devices: int, model_degrees: Sequence[int] | None,
                          context_degrees: Sequence[int] | None) -> list[tuple[int, int]]:
    """``split_degrees``, refused when no pair of them divides ``n_devices``."""
    degrees = split_degrees(n_devices, model_degrees, context_degrees)
    if not degrees:
        raise ValueError(f"No n_model_shards in {model_degrees} and n_context_shards in "
                         f"{context_degrees} together divide {n_devices} devices.")
    return degrees


def lora_models(params_abstract, loss: Callable, rank: int | None, lora: Callable | None,
                trainable: Any, bases: dict) -> dict[str | None, Callable[[], LoraModel]]:
    """The LoRA models to try after full fine-tuning, in order, as ``{base format: builder}``:
    LoRA of ``rank`` on the params (None; not when ``trainable`` says they hold adapters
    already), then over each quantised base."""
    models = {} if rank is None or trainable is not None else \
        {None: lambda: (lora or generic_lora(params_abstract, loss))(rank)}
    models.update({fmt: (lambda base=base: base) for fmt, base in bases.items()})  # (built)
    return models


def search_lora_models(search: Search, pick, models: dict, batch_abstract,
                       rank: int | None) -> tuple[Any, dict]:
    """After full fine-tuning's ``pick`` (None: nothing fit), each LoRA model in turn
    (``{base format: () -> LoraModel}``, built only when tried) while nothing fits, or every
    one with ``search.try_all``: the first pick, and each tried model's ``via`` by format."""
    vias = {}
    for fmt, build in models.items():
        if pick is None or search.try_all:
            model = build()
            vias[fmt] = model.via
            found = search_lora(search, model, batch_abstract, rank, fmt)
            pick = pick or found
    return pick, vias


def check_sequence_split(search: Search, context_degrees: Sequence[int] | None) -> None:
    """Refuse when every layout asked for split the sequence and the model cannot (none tried)."""
    if not search.tried and not search.splits_sequence:
        raise PlanError(f"Every layout asked for splits the sequence (n_context_shards in "
                        f"{context_degrees}), but the model's attention cannot run over a split "
                        "sequence: use a zoo LLaMA-family or GPT-2 model, or n_context_shards=1.")


def as_plan(pick, tried: list, vias: dict, device_memory_bytes: int, n_devices: int,
            headroom: float) -> Plan:
    """The ``Plan`` of layout ``pick`` among ``tried``, with how its LoRA model was built."""
    lora_via = vias.get(pick.quantized, "") if pick.lora_rank else ""
    return Plan(pick.n_model_shards, pick.sharding_rules, pick.rules, pick.peak_bytes,
                device_memory_bytes, n_devices, tried, headroom, pick.remat,
                why(pick, tried, lora_via), pick.lora_rank, lora_via,
                pick.n_context_shards, pick.n_expert_shards, pick.quantized)


def search_lora(search: Search, model: LoraModel, batch_abstract, rank: int,
                quantized: str | None = None):
    """``search.run`` over ``model``'s params with only its adapters trained, each layout
    marked with ``rank`` and the base's format ``quantized``."""
    return search.run(abstract(model.params), model.loss,
                      dataflow_trace(model.loss, batch_abstract),
                      redco_lora.trainable_mask(model.params), rank, model.overrides, quantized)


def with_expert_parallel(rule_sets: Sequence[str], params_abstract) -> list[str]:
    """``rule_sets`` with, for a model with experts (``redco.builtins.rules.has_experts``),
    each one's expert-parallel variant (``EXPERT_PARALLEL``, in that order) in its place."""
    return expert_parallel_variants(rule_sets) if has_experts(params_abstract) \
        else list(rule_sets)


def expert_parallel_variants(rule_sets: Sequence[str]) -> list[str]:
    """``rule_sets`` with each one's expert-parallel variant (``EXPERT_PARALLEL``) in its place."""
    return list(dict.fromkeys(name for base in rule_sets
                              for name in EXPERT_PARALLEL.get(base, (base,))))


def generic_lora(params_abstract, loss: Callable, alpha: float = 16.0) -> Callable[[int], LoraModel]:
    """``rank -> LoraModel``: ``redco.lora.add_adapters`` on the default targets, the loss
    on the params with the adapters merged in (a full-size merged kernel per layer)."""
    def build(rank: int) -> LoraModel:
        params = jax.eval_shape(lambda p: redco_lora.add_adapters(p, rank), params_abstract)
        return LoraModel(params, lambda p, b: loss(redco_lora.merge(p, alpha), b),
                         "redco.lora.add_adapters, merged into the kernels in the loss")
    return build


def effective_policies(policies: Sequence[str], loss: Callable, params_abstract,
                       batch_abstract) -> list[str]:
    """``policies`` (checked, in order), or only ``"none"`` when tracing ``loss`` under a
    policy runs no ``redco.remat.layer`` (every policy would compile the same step). Where
    ``"none"`` runs remat layers, they are a scanned stack's (``redco.remat.scanned_body``:
    ``"none"`` there keeps what ``SCANNED_NONE`` keeps), and beside ``"none"`` the policies that
    keep as much there (``SCANNED_REDUNDANT``) are dropped: they could only compile a bigger
    step. A stack scanned in part (Gemma 3's last layers, runs of their own) counts as scanned."""
    policies = [redco_remat.check(name) for name in policies]
    if not policies:
        raise ValueError("remat_policies is empty: give at least one, e.g. ('none',).")
    others = [name for name in policies if name != "none"]
    if not others:
        return policies
    if "none" in policies and remat_layers("none", loss, params_abstract, batch_abstract):
        return [name for name in policies if name not in SCANNED_REDUNDANT]
    if not remat_layers(others[0], loss, params_abstract, batch_abstract):
        return policies[:1]
    return policies


def remat_layers(policy: str, loss: Callable, params_abstract, batch_abstract) -> int:
    """How many ``redco.remat.layer`` calls tracing ``loss`` under ``policy`` checkpoints (a
    scanned body's layers are traced once for the whole stack)."""
    before = redco_remat.layers_traced()
    with redco_remat.policy(policy):  # a fresh function: a cached trace would count none
        jax.eval_shape(lambda p, b: loss(p, b), params_abstract, batch_abstract)
    return redco_remat.layers_traced() - before
