"""What the planner reports: each layout it tried (``TriedLayout``: the compiled step's memory
per device, or why it could not be measured), the pick (``Plan``) and why it is the pick, or the
error when nothing fits (``PlanError``). ``usable_bytes`` is where "fits" is drawn: the device
memory less ``HEADROOM`` (why 10%: ``redco_planner.planner``'s docstring)."""
from __future__ import annotations

from dataclasses import dataclass, field

from redco.sharding import Rules
from redco_planner.inspection import human_bytes

HEADROOM = 0.1  # the fraction of device memory a plan leaves free
def usable_bytes(device_memory_bytes: int, headroom: float = HEADROOM) -> int:
    """The most a layout's compiled per-device peak may be: ``device_memory_bytes`` less the
    ``headroom`` fraction kept for what XLA's buffer assignment does not see."""
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom={headroom!r} must be in [0, 1).")
    return int(device_memory_bytes * (1 - headroom))


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
    state_bytes: int = 0  # params and optimizer state per device, from the shardings alone
    over_budget: int | None = None  # not compiled: state_bytes alone is over these usable bytes
    compile_s: float = 0.0
    fits: bool = False
    error: str | None = None  # could not be measured: the exception, type and message
    out_of_memory: str | None = None  # does not fit: XLA's RESOURCE_EXHAUSTED while compiling
    rules: Rules = field(default_factory=list, repr=False)
    remat: str = "none"  # the redco.remat policy the step was compiled under
    flops: float | None = None  # per device, one update: XLA's count + its loops' repeats (measure)
    bytes_accessed: float | None = None  # per device: XLA's cost_analysis (a loop's body once)
    lora_rank: int | None = None  # LoRA adapters' rank (base frozen); None: full fine-tuning
    quantized: str | None = None  # the frozen base's projections in this format (QLoRA), or None
    n_context_shards: int = 1  # cp: devices that split each sequence
    collectives: dict = field(default_factory=dict)  # redco.hlo_collectives of the step

    @property
    def mesh_shape(self) -> dict:
        return {"dp": self.n_devices // (self.n_model_shards * self.n_context_shards),
                "cp": self.n_context_shards, "mp": self.n_model_shards}

    @property
    def n_expert_shards(self) -> int:
        """Devices the experts are split over: ``dp`` under the ``+ep`` rule sets, else 1."""
        return self.mesh_shape["dp"] if self.sharding_rules.endswith("+ep") else 1

    def describe(self) -> str:
        cp = f"cp={self.n_context_shards:<3} " if self.n_context_shards > 1 else ""
        ep = f"ep={self.n_expert_shards:<3} " if self.n_expert_shards > 1 else ""
        name = (f"mp={self.n_model_shards:<3} {cp}dp={self.mesh_shape['dp']:<3} {ep}"
                f"{self.sharding_rules:<10}")
        if self.remat != "none":
            name += f" remat={self.remat}"
        if self.lora_rank is not None:
            name += f" lora r={self.lora_rank}" + (f" over {self.quantized}" if self.quantized
                                                   else "")
        if self.error:
            return f"{name} could not be measured: {self.error}"
        if self.over_budget is not None:
            return (f"{name} does not fit: its params and optimizer state alone are "
                    f"{human_bytes(self.state_bytes)} per device, over the "
                    f"{human_bytes(self.over_budget)} usable (not compiled)")
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
    n_expert_shards: int = 1  # devices the experts are split over (dp under +ep rules), or 1
    quantize_base: str | None = None  # the pick's frozen base in this format (QLoRA), or None

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
                     f"n_context_shards={self.n_context_shards}, {expert_shards(self)}"
                     f"sharding_rules={self.sharding_rules!r}, remat={self.remat!r}"
                     f"{'' if self.lora_rank is None else ', ' + training(self)}, peak "
                     f"{human_bytes(self.peak_bytes)} per device "
                     f"({100 * self.peak_bytes / self.device_memory_bytes:.0f}% of memory)")
        lines.append(f"why: {self.reason}")
        return "\n".join(lines)


def nothing_fits(tried: list[TriedLayout], n_devices: int, device_memory_bytes: int,
                 headroom: float) -> PlanError:
    """The error when no layout fits: the smallest peak found, the smallest state if every
    layout's state alone was over the budget, or why none compiled."""
    measured = [t for t in tried if t.peak_bytes is not None]
    over = [t for t in tried if t.over_budget is not None]
    if not measured and not over:
        return PlanError(f"No layout was found for {n_devices} devices: "
                         + "; ".join(t.describe() for t in tried), tried)
    usable = usable_bytes(device_memory_bytes, headroom)
    budget = (f"No layout fits {human_bytes(device_memory_bytes)} per device on {n_devices} "
              f"devices, less the {headroom:.0%} headroom (at most {human_bytes(usable)} per "
              f"device, {usable} bytes): ")
    if not measured:
        least = min(over, key=lambda t: t.state_bytes)
        return PlanError(
            budget + f"even the params and optimizer state alone need at least "
            f"{human_bytes(least.state_bytes)} ({where(least, least.state_bytes)}), before "
            "activations. Use more devices or more memory per device, LoRA (--lora_rank), or a "
            "smaller model.", tried)
    unmeasured = "; ".join(t.describe() for t in tried if t.error)
    best = min(measured, key=lambda t: t.peak_bytes)
    return PlanError(
        budget + f"the smallest per-device peak found is {human_bytes(best.peak_bytes)} "
        f"({where(best, best.peak_bytes)}). Use more devices or more memory per device, a "
        "smaller batch or sequence, or a smaller model."
        + (f" Not compared, since not measured: {unmeasured}" if unmeasured else ""), tried)


def where(layout: TriedLayout, n_bytes: int) -> str:
    """``123 bytes, n_model_shards=2, sharding_rules='auto'``: a figure and its layout."""
    return (f"{n_bytes} bytes, n_model_shards={layout.n_model_shards}, "
            f"sharding_rules={layout.sharding_rules!r}")


def split_name(layout: TriedLayout) -> str:
    """``mp=2``, or ``mp=2 cp=4`` for a layout that splits the sequence."""
    cp = layout.n_context_shards
    return f"mp={layout.n_model_shards}" + (f" cp={cp}" if cp > 1 else "")


def why(pick: TriedLayout, tried: list[TriedLayout], lora_via: str = "") -> str:
    """Why ``pick``: the layouts with fewer devices per example (smaller mp, or mp x cp), and
    the lighter policies at its own, that did not fit (and, for LoRA, that no full fine-tuning
    layout did)."""
    same_kind = [t for t in tried if (t.lora_rank, t.quantized) == (pick.lora_rank,
                                                                      pick.quantized)]
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
        before = nothing_before(pick, tried)
        reason = f"{before}; " * bool(before) + f"with {training(pick)} ({lora_via}), {reason}"
    reason += expert_reason(pick, [t for t in same_kind[:same_kind.index(pick)] if at_pick(t)])
    if pick.remat == "none":
        return f"{reason}; at {split_name(pick)} it fits without remat"
    lighter = [t.remat for t in same_kind[:same_kind.index(pick)]
               if at_pick(t) and t.sharding_rules == pick.sharding_rules and t.remat != pick.remat]
    return (f"{reason}; at {split_name(pick)} {pick.sharding_rules} fits only with "
            f"remat={pick.remat} (not with {', '.join(lighter)})")


def training(layout, unquantised: str = "") -> str:
    """What ``layout`` (a ``TriedLayout`` or ``Plan``) trains: ``full fine-tuning``, ``LoRA rank
    8`` (``unquantised`` appended), or ``LoRA rank 8 over an NF4 base`` (QLoRA)."""
    fmt = getattr(layout, "quantized", None) or getattr(layout, "quantize_base", None)
    if layout.lora_rank is None:
        return "full fine-tuning"
    return f"LoRA rank {layout.lora_rank}" + (f" over an {fmt.upper()} base" if fmt
                                              else unquantised)


def nothing_before(pick: TriedLayout, tried: list[TriedLayout]) -> str:
    """The trainings tried before ``pick``'s, none of which fits: ``no full fine-tuning layout
    fits, nor LoRA rank 8 over the unquantised base, nor LoRA rank 8 over an INT8 base``."""
    kinds = list(dict.fromkeys(training(t, " over the unquantised base") for t in tried))
    before = kinds[:kinds.index(training(pick, " over the unquantised base"))]
    if not before:
        return ""
    first = "no full fine-tuning layout fits" if before[0] == "full fine-tuning" else \
        f"no layout fits {before[0]}"
    return first + "".join(f", nor {kind}" for kind in before[1:])


def expert_shards(layout) -> str:
    """``n_expert_shards=8, `` for a layout that splits the experts, else nothing."""
    return f"n_expert_shards={layout.n_expert_shards}, " if layout.n_expert_shards > 1 else ""


def expert_reason(pick: TriedLayout, before: list[TriedLayout]) -> str:
    """Why the experts are split (or not), from the rule sets tried before ``pick`` at its mp
    and cp: ``; experts split over ep=8 devices (auto+ep), as auto did not fit``."""
    if pick.n_expert_shards == 1:
        return ""
    others = list(dict.fromkeys(t.sharding_rules for t in before if not t.n_expert_shards > 1))
    return (f"; experts split over ep={pick.n_expert_shards} devices ({pick.sharding_rules})"
            + (f", as {' and '.join(others)} did not fit" if others else ""))
