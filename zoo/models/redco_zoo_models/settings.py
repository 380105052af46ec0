"""A zoo run's resolved settings as a typed object: what library code takes instead of argparse's
namespace.

``RunConfig`` groups the settings every pipeline shares by concern (where the model comes from,
the data, the device layout, the optimizer, the loop's cadences, LoRA), each group a frozen
dataclass, plus ``task``: the pipeline's own group (``redco_zoo_lm.settings.LMData``, ...).
A library function takes the group it needs (``token_rows`` the ``LMData``, ``optimizer_of``
the ``Optimizer``), ``train_and_eval`` the whole ``RunConfig``. Built in Python, a run needs no
parser: ``RunConfig(workdir=..., source=ModelSource("llama-1b", from_scratch=True),
data=Data("corpus.bin"), task=LMData(block_size=2048))``.

On the command line the namespace stops at the pipeline's ``run``: ``RunConfig.of_flags(args,
LMData)`` makes the typed object once. A field is named as its flag (a group's ``prefix``
prepended: ``LoRA.rank`` is ``--lora_rank``), so the mapping is by name, and a flag that lands
in no field is refused (a flag added without its field would otherwise be silently ignored).
The defaults here are the flags' defaults (``flags.py`` reads them).
"""
from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any, Generic, TypeVar

from redco.lora import DEFAULT_TARGETS
from redco.protocols import UsageError
from redco.remat import POLICIES
from redco.sequence_split import STRATEGIES

T = TypeVar("T")
COMPUTE_DTYPES = ("float32", "bfloat16")
SCHEDULES = ("linear", "cosine")
QUANTIZE_FORMATS = ("nf4", "int8", "fp8")  # (redco_zoo_models.quantize.FORMATS)
QUANTIZE_CHOICES = (*QUANTIZE_FORMATS, "auto")  # auto: the planner picks (base_plan)


def check_choice(group: object, name: str, choices) -> None:
    """Refuse ``group``'s field ``name`` unless it is one of ``choices``, naming them."""
    value = getattr(group, name)
    if value not in choices:
        raise UsageError(f"{type(group).__name__}({name}={value!r}): choose one of "
                         f"{list(choices)} (the flag --{name}).")


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """The model: a local HuggingFace directory, or (``from_scratch``) untrained, of a
    directory's ``config.json`` or a preset's name; ``scan_layers``: a decoder's layers stored
    stacked and run under ``jax.lax.scan`` (``redco_zoo_models.layer_scan``; None, the default:
    wherever the model can; False: unrolled); ``quantize_base``
    (``nf4``, ``int8``, ``fp8``): the attention and MLP projections held quantised and frozen,
    for LoRA to train over (QLoRA, ``redco_zoo_models.quantized_linear``); with
    ``n_model_shards="auto"`` (and ``auto`` here) the planner decides whether and how before
    the model is loaded (``redco_zoo_models.base_plan``)."""
    model: str
    from_scratch: bool = False
    scan_layers: bool | None = None
    quantize_base: str | None = None

    def __post_init__(self):
        if self.quantize_base is not None:
            check_choice(self, "quantize_base", QUANTIZE_CHOICES)


@dataclasses.dataclass(frozen=True)
class Data:
    """The training data, and the evaluation data (``None``: the last 5% of ``train``)."""
    train: str
    eval: str | None = None


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the step is laid out on the devices (``Deployer`` and ``Trainer``'s levers)."""
    n_model_shards: int | str = 1  # or "auto": the layout planner picks it
    device_memory: str | None = None  # one device's memory, for "auto"
    sharding_rules: str = "auto"  # the rule set (no flag: what base_plan planned)
    n_context_shards: int = 1
    context_strategy: str = STRATEGIES[0]
    expert_parallel: bool = False
    remat: str = "none"
    compute_dtype: str = COMPUTE_DTYPES[0]

    def __post_init__(self):
        for name, choices in (("context_strategy", STRATEGIES), ("remat", POLICIES),
                              ("compute_dtype", COMPUTE_DTYPES)):
            check_choice(self, name, choices)


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """AdamW after optional clipping, and its learning rate's schedule."""
    learning_rate: float = 1e-4
    warmup_rate: float = 0.05
    schedule: str = SCHEDULES[0]  # the decay after warmup
    weight_decay: float = 1e-4
    max_grad_norm: float | None = None

    def __post_init__(self):
        check_choice(self, "schedule", SCHEDULES)


@dataclasses.dataclass(frozen=True)
class Loop:
    """How long the run trains, in batches of what size, and how often it evaluates and
    saves."""
    per_device_batch_size: int = 8
    n_epochs: int = 2
    max_steps: int | None = None  # updates across epochs, instead of n_epochs
    accumulate_grad_batches: int = 1
    eval_steps: int = 100  # batches evaluated at most (0: all)
    eval_every_n_steps: int | None = None
    save_every_n_steps: int | None = None


@dataclasses.dataclass(frozen=True)
class LoRA:
    """LoRA adapters of ``rank`` on the kernels ``targets`` selects (rank 0: train the whole
    model)."""
    rank: int = 0
    alpha: float = 16.0
    targets: str = DEFAULT_TARGETS


@dataclasses.dataclass(frozen=True)
class RunConfig(Generic[T]):
    """One zoo run's settings (module docstring); ``task``: the pipeline's own group."""
    source: ModelSource
    data: Data
    workdir: str = "./workdir"
    jax_seed: int = 42
    layout: Layout = Layout()
    optimizer: Optimizer = Optimizer()
    loop: Loop = Loop()
    lora: LoRA = dataclasses.field(default=LoRA(), metadata={"prefix": "lora_"})
    task: T | None = None

    @classmethod
    def of_flags(cls, flags: Any, task: type | None = None, strict: bool = True) -> RunConfig:
        """The typed settings of parsed ``flags`` (an ``argparse.Namespace`` or a mapping);
        ``task``: the pipeline's own group's class. ``strict``: refuse a flag no field takes
        (a script that adds flags of its own and reads them itself passes False)."""
        flags = dict(vars(flags) if not isinstance(flags, Mapping) else flags)
        taken: set[str] = set()
        config = group_of(cls, flags, "", taken, {"task": task})
        if strict and set(flags) - taken:
            raise TypeError(f"flags that no field of {cls.__name__} or "
                            f"{getattr(task, '__name__', task)} takes: "
                            f"{sorted(set(flags) - taken)}; add each to its group.")
        return config

    def __post_init__(self):
        if self.source.quantize_base:
            refuse_with_quantized(self)


def refuse_with_quantized(config: RunConfig) -> None:
    """Refuse, before anything is built, what a quantised base cannot do, naming the fix: train
    without LoRA, or leave ``auto`` to a planner that is not asked."""
    fmt = config.source.quantize_base
    if not config.lora.rank:
        raise UsageError(f"--quantize_base {fmt} without --lora_rank: a quantised base is frozen "
                         "and cannot be trained; add --lora_rank (e.g. 8) to train LoRA adapters "
                         "over it, or drop --quantize_base.")
    if fmt == "auto" and config.layout.n_model_shards != "auto":
        raise UsageError("--quantize_base auto lets the layout planner choose the base's format "
                         "with the layout: add --n_model_shards auto, or name a format (nf4, "
                         "int8, fp8).")


def check_config(config: Any, where: str) -> None:
    """Refuse anything but a ``RunConfig`` (argparse's namespace above all) at ``where``."""
    if not isinstance(config, RunConfig):
        raise TypeError(f"{where} takes a RunConfig, not a {type(config).__name__}: make it "
                        "once from the command line's namespace with RunConfig.of_flags(args, "
                        "TaskSettings), or build it in Python (redco_zoo_models.settings).")


def group_of(cls: type, flags: dict, prefix: str, taken: set[str],
             classes: Mapping[str, type | None] | None = None) -> Any:
    """``cls`` with each field the flag of its name (``prefix`` prepended), a field that is a
    group made the same way; the flags used are added to ``taken``."""
    hints = typing.get_type_hints(cls)
    values = {}
    for field in dataclasses.fields(cls):
        kind = (classes or {}).get(field.name, hints[field.name])
        if kind is None:
            continue
        if dataclasses.is_dataclass(kind):
            values[field.name] = group_of(kind, flags, prefix + field.metadata.get("prefix", ""),
                                          taken)
        elif prefix + field.name in flags:
            values[field.name] = flags[prefix + field.name]
            taken.add(prefix + field.name)
    return cls(**values)
