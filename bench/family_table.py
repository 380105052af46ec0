"""The published decoders the planner knows (``redco_zoo_models.presets``), in the spirit of the
paper's Table 1: for each model, full fine-tuning and LoRA on 1 x 80 GB, 8 x 80 GB and
8 x 16 GB, the planner's pick (layout and remat policy) and its per-device peak, or "does not
fit", by ahead-of-time compilation on simulated CPU devices (nothing is allocated).

Every cell is what ``redco_planner.planner.plan`` picks for one row of ``--seq_len`` tokens per
device (global batch = dp rows), bf16 compute with fp32 params and AdamW state
(``compute_dtype=jnp.bfloat16``, as ``Trainer(compute_dtype=...)``), the whole-logits
next-token loss of ``redco plan --model <name>`` (``redco_planner.models.zoo_decoder``):
the layouts in ``plan``'s order (``n_model_shards`` 1, 2, 4, 8; ``auto`` then ``auto+fsdp``;
remat ``none``, ``dots_saveable``, ``full``), the first whose compiled peak fits 90% of the
memory. LoRA (rank ``--lora_rank``, the zoo's native layers on the attention and MLP
projections) is planned on its own (``plan(trainable=...)``), not only after full fine-tuning
failed. On one device only ``auto`` is tried (every rule set shards nothing there).

Two things make it affordable, neither changing a pick:

* A layout whose params and AdamW state alone (per device, from its shardings) exceed the
  usable memory is not compiled (the planner's own rule, ``redco_planner.measure``): the
  compiled peak counts them among its arguments, so it cannot fit. A cell whose state does
  not fit even sharded over every device is "does not fit" without any compile.
* Each compile is kept (``--cache``, a JSON file), so 8 x 80 GB and 8 x 16 GB share the layouts
  both walk through, and an interrupted run resumes where it stopped.

``--extrapolate`` (for the models whose full-depth compiles take minutes each here) compiles
each layout at the model's first 3 and 4 layers instead (``cut_decoders``) and carries the peak
to full depth by ``depth_rule`` (its error against full-depth compiles:
``bench/depth_rule_check.py``); the state checks stay exact, and a cell whose walk went
through such a layout is marked with a dagger. ``--levers`` and ``--servers`` pick the cells.

``--scan_layers`` plans each model with its layers stored stacked and scanned
(``redco_zoo_models.layer_scan``): every layout compiled at full depth, in a compile time that
no longer grows with depth (BENCHMARKS.md section 33), so the cuts and the depth rule are not
needed; its cells are the scanned step's own peaks (more temp memory than unrolled, section
33), kept in the cache under ``<model> scanned``, LoRA's too (adapters stacked with their
kernels). Not with ``--extrapolate`` (the rule carries an unrolled step's peak, which
``bench/depth_rule_check.py`` keeps checking).

Each model runs in its own process (XLA:CPU's compile memory is freed between models), the
smallest model first, until ``--budget_minutes`` is spent; the table marks what did not run.

CPU buffer assignment stands in for a GPU's: XLA:CPU fuses less and never rematerialises on
its own (BENCHMARKS.md section 4 and "The paper's Table 1"), so peaks are on the safe side.

Run:  python bench/family_table.py [--models qwen3-0.6b,...] [--seq_len 2048]
          [--budget_minutes 60] [--cache family_table.json] [--table_only | --states_only]
          [--extrapolate | --scan_layers] [--levers full,LoRA]
          [--servers "8 x 80 GB,8 x 16 GB"]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

GiB = 1024 ** 3
HARDWARE = {"1 x 80 GB": (1, 80 * GiB), "8 x 80 GB": (8, 80 * GiB), "8 x 16 GB": (8, 16 * GiB)}
LEVERS = ("full", "LoRA")
QUANTIZED = {"QLoRA int8": "int8", "QLoRA nf4": "nf4"}  # (bench/qlora_plans.py)
HERE = Path(__file__).resolve().parent


# ---- the walk: plan's candidates in order, the first that fits ---------------------------------
def candidates(n_devices: int, policies: list[str], experts: bool = False
               ) -> list[tuple[int, str, str]]:
    """``(mp, rule set, remat)`` in ``plan``'s order for ``n_devices`` (no context parallelism;
    for a model with ``experts``, each rule set's expert-parallel variant in its place)."""
    from redco_planner.planner import expert_parallel_variants, split_degrees
    rule_sets = ("auto",) if n_devices == 1 else ("auto", "auto+fsdp")
    rule_sets = expert_parallel_variants(rule_sets) if experts else rule_sets
    return [(mp, name, policy) for mp, _ in split_degrees(n_devices)
            for name in rule_sets for policy in policies]


def walk(cands: list, usable: int, entry: Callable[[tuple], dict | None]) -> dict:
    """The first candidate whose entry fits ``usable``: ``{"pick": cand, **its entry}``;
    ``{"pick": None, "best": smallest peak, "floor": smallest state}`` when none does;
    ``{"incomplete": cand}`` where ``entry`` has nothing for a candidate it must see."""
    best, floors, errors, carried = None, [], 0, False
    for cand in cands:
        found = entry(cand, usable)
        if found is None:
            return {"incomplete": cand}
        floors.append(found["floor"])
        carried |= "cuts" in found
        peak = found.get("peak")
        if peak is not None and peak <= usable:
            return {"pick": cand, **found, "extrapolated": carried}
        if peak is not None and (best is None or peak < best):
            best = peak
        errors += bool(found.get("error")) and peak is None
    return {"pick": None, "best": best, "floor": min(floors) if floors else None,
            "errors": errors, "extrapolated": carried}


def key(model: str, lever: str, n_devices: int, cand: tuple) -> str:
    mp, name, policy = cand
    return f"{model}|{lever}|{n_devices}|mp={mp}|{name}|{policy}"


# ---- the worker: one model, every cell ---------------------------------------------------------
def lever_parts(model, lever: str, rank: int) -> tuple[Any, Callable, Any, Any]:
    """``(params, loss, trainable mask or None, rule overrides or None)`` of the model for full
    fine-tuning, LoRA, or LoRA over a quantised base (``QUANTIZED``: its parts' rules)."""
    from redco import lora
    if lever == "full":
        return model.params, model.loss_fn, None, None
    adapters = model.quantized(rank, QUANTIZED[lever]) if lever in QUANTIZED else \
        model.lora(rank)
    return adapters.params, adapters.loss, lora.trainable_mask(adapters.params), \
        adapters.overrides


def total_state_bytes(params, trainable) -> int:
    """On one device: the params and AdamW's two moments of the trained ones."""
    import jax
    import numpy as np
    leaves = jax.tree.leaves(params)
    mask = [True] * len(leaves) if trainable is None else jax.tree.leaves(trainable)
    sizes = [x.size * np.dtype(x.dtype).itemsize for x in leaves]
    return sum(sizes) + 2 * sum(b for b, t in zip(sizes, mask) if t)


class Worker:
    """Walks one model's cells, measuring what the cache lacks, saving after every compile."""

    def __init__(self, name: str, seq_len: int, rank: int, cache_path: str,
                 extrapolate: bool = False, scan_layers: bool = False):
        from redco_planner.inspection import load_model
        self.name, self.rank, self.cache_path = label(name, scan_layers), rank, cache_path
        self.seq_len, self.extrapolate = seq_len, extrapolate
        self.model = load_model(name, seq_len=seq_len, scan_layers=scan_layers)
        self.batch = self.model.batch(1)

    def load(self) -> dict:
        return json.loads(Path(self.cache_path).read_text()) if os.path.exists(self.cache_path) \
            else {}

    def save(self, k: str, value: dict) -> None:
        cache = self.load()  # (re-read: the file is this run's alone, but stay safe)
        cache[k] = value
        Path(self.cache_path).write_text(json.dumps(cache, indent=1, sort_keys=True))

    def run(self, states_only: bool = False, levers: tuple[str, ...] = LEVERS,
            servers: tuple[str, ...] = tuple(HARDWARE)) -> None:
        """The model's cells of ``levers`` x ``servers`` (``states_only``: only what its state
        alone decides)."""
        import jax.numpy as jnp
        import optax

        from redco.builtins.rules import has_experts
        from redco.sharding import dataflow_trace
        from redco_planner.planner import REMAT_POLICIES, effective_policies
        for lever in levers:
            params, loss, trainable, overrides = lever_parts(self.model, lever, self.rank)
            total = total_state_bytes(params, trainable)
            experts = has_experts(params)
            self.save(f"{self.name}|{lever}|state", {"bytes": total, "experts": experts})
            if states_only:
                continue
            trace_fn = dataflow_trace(loss, self.batch)
            policies = effective_policies(REMAT_POLICIES, loss, params, self.batch)
            for hardware in servers:
                n, memory = HARDWARE[hardware]
                ctx = dict(lever=lever, params=params, loss=loss, trainable=trainable,
                           trace_fn=trace_fn, n=n, compute_dtype=jnp.bfloat16,
                           optimizer=optax.adamw, overrides=overrides)
                if total / n > usable(memory):
                    log(f"{self.name} {lever} {hardware}: the state alone does not fit")
                    continue
                result = walk(candidates(n, policies, experts), usable(memory),
                              lambda cand, limit: self.entry(cand, limit, ctx))
                log(f"{self.name} {lever} {hardware}: {describe(result)}")

    def entry(self, cand: tuple, limit: int, ctx: dict) -> dict:
        """The cached entry of ``cand``; its state computed, and its step compiled if that
        state is within ``limit``, where the cache lacks them."""
        from redco_planner.measure import measure
        k = key(self.name, ctx["lever"], ctx["n"], cand)
        found = self.load().get(k)
        if found is None:
            found = {"floor": measure(  # skip_above=0: the state's bytes, nothing compiled
                ctx["params"], ctx["loss"], self.batch, ctx["n"], cand[0], cand[1],
                ctx["optimizer"], ctx["trace_fn"], trainable=ctx["trainable"],
                skip_above=0, overrides=ctx["overrides"]).state_bytes}
            self.save(k, found)
        if "peak" in found or "cuts" in found or found["floor"] > limit:
            return with_extrapolation(self.name, found)
        start = time.perf_counter()
        found.update(self.extrapolated(cand, limit, ctx) if self.extrapolate
                     else self.compiled(cand, limit, ctx))
        found["compile_s"] = round(time.perf_counter() - start, 1)
        self.save(k, found)
        found = with_extrapolation(self.name, found)
        log(f"  {k}: {found.get('peak')} bytes{' (extrapolated)' * self.extrapolate}")
        return found

    def compiled(self, cand: tuple, limit: int, ctx: dict) -> dict:
        """The layout's step compiled at full depth."""
        from redco_planner.search import try_layout
        mp, name, policy = cand
        layout = try_layout(ctx["params"], ctx["loss"], self.batch, ctx["n"], mp, name,
                            ctx["optimizer"], ctx["trace_fn"], policy, ctx["trainable"], limit,
                            compute_dtype=ctx["compute_dtype"], overrides=ctx["overrides"])
        return dict(peak=layout.peak_bytes, temp=layout.temp_bytes, params=layout.params_bytes,
                    error=layout.error or layout.out_of_memory)

    def extrapolated(self, cand: tuple, limit: int, ctx: dict) -> dict:
        """The layout's step compiled at the cuts of ``cut_decoders``; its peak carried to
        full depth by ``depth_rule`` when the cache is read (``with_extrapolation``)."""
        from cut_decoders import compile_cuts
        cuts = compile_cuts(self.name, self.seq_len,
                            lambda model: lever_parts(model, ctx["lever"], self.rank),
                            ctx["n"], cand, limit, ctx["compute_dtype"])
        errors = [c["error"] for c in cuts.values() if "error" in c]
        return {"cuts": cuts, "error": errors[0] if errors else None}


def label(model: str, scan_layers: bool) -> str:
    """The name a model's cells are kept and shown under: ``<model> scanned`` with
    ``--scan_layers``."""
    return f"{model} scanned" if scan_layers else model


def with_extrapolation(model: str, found: dict) -> dict:
    """A cache entry with its ``peak``: compiled, or carried from its cuts' compiles by
    ``depth_rule`` (None where a cut was over the memory or failed)."""
    if "cuts" not in found:
        return found
    from cut_decoders import extrapolated_peak
    return {**found, "peak": extrapolated_peak(model, found["floor"], found["cuts"])}


def usable(memory: int) -> int:
    from redco_planner.layouts import usable_bytes
    return usable_bytes(memory)


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# ---- the table ---------------------------------------------------------------------------------
def describe(result: dict) -> str:
    """A cell: the pick and its peak, "does not fit" and why, or "not run"; a dagger where a
    layout of its walk was compiled at cuts and carried to full depth (``--extrapolate``)."""
    return plain(result) + (" †" if result.get("extrapolated") else "")


def plain(result: dict) -> str:
    if "incomplete" in result:
        return "not run"
    if result.get("state_only"):
        return f"does not fit (params + AdamW state alone {result['floor'] / GiB:.0f} GiB/device)"
    if result["pick"] is None:
        errors = f"; {result['errors']} layouts failed to compile" if result["errors"] else ""
        if result["best"] is None:
            return (f"does not fit (state alone ≥ {result['floor'] / GiB:.1f} GiB per "
                    f"device{errors})")
        return f"does not fit (best {result['best'] / GiB:.1f} GiB{errors})"
    mp, name, policy = result["pick"]
    return f"mp={mp} {name}, remat {policy}: {result['peak'] / GiB:.1f} GiB"


def cell(cache: dict, model: str, lever: str, hardware: str) -> str:
    """One cell from the cache alone (nothing compiled): the walk replayed."""
    from redco_planner.planner import REMAT_POLICIES
    n, memory = HARDWARE[hardware]
    state = cache.get(f"{model}|{lever}|state")
    if state is None:
        return "not run"
    if state["bytes"] / n > usable(memory):
        return describe({"state_only": True, "floor": state["bytes"] / n})
    cands = candidates(n, list(REMAT_POLICIES), state.get("experts", False))

    def entry(cand, limit):
        found = cache.get(key(model, lever, n, cand))
        if found is None or not ({"peak", "cuts"} & set(found) or found["floor"] > limit):
            return None
        return with_extrapolation(model, found)
    return describe(walk(cands, usable(memory), entry))


def n_params(model: str) -> str:
    from redco_zoo_models import presets_vlm
    from redco_zoo_models.presets import PUBLISHED_PARAMS
    counts = {**PUBLISHED_PARAMS, **presets_vlm.PUBLISHED_PARAMS}  # (image-text: section 44)
    return f"{counts[model.split()[0]] / 1e9:.2f}B"


def table(cache: dict, models: list[str], seq_len: int, rank: int) -> str:
    lines = [f"seq_len {seq_len}, one row per device, bf16 compute, fp32 params and AdamW; "
             f"LoRA rank {rank}; a layout fits at 90% of the memory",
             "| model | params | training | " + " | ".join(HARDWARE) + " |",
             "|---|---:|---|" + "---|" * len(HARDWARE)]
    for model in models:
        for lever in LEVERS:
            cells = [cell(cache, model, lever, h) for h in HARDWARE]
            lines.append(f"| {model} | {n_params(model)} | {lever} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def compile_minutes(cache: dict, model: str) -> float:
    return sum(v.get("compile_s", 0) for k, v in cache.items() if k.startswith(model + "|")) / 60


# ---- the driver --------------------------------------------------------------------------------
def run_models(models: list[str], args: argparse.Namespace) -> None:
    """One worker process per model, smallest first, until the budget is spent."""
    deadline = time.time() + 60 * args.budget_minutes
    for model in models:
        left = deadline - time.time()
        if left <= 0:
            log(f"budget spent: {model} and the models after it not run")
            return
        cmd = [sys.executable, __file__, "--worker", model, "--seq_len", str(args.seq_len),
               "--lora_rank", str(args.lora_rank), "--cache", args.cache]
        cmd += ["--levers", args.levers, "--servers", args.servers]
        cmd += ["--states_only"] * args.states_only + ["--extrapolate"] * args.extrapolate
        cmd += ["--scan_layers"] * args.scan_layers
        if not within_budget(cmd, model, left):
            return


def within_budget(cmd: list[str], model: str, left: float) -> bool:
    """Run one model's worker ``cmd`` for at most ``left`` seconds; False if the budget ran out
    (its compiles so far stay in the cache)."""
    log(f"== {model} ({left / 60:.0f} min left)")
    proc = subprocess.Popen(cmd)
    try:
        proc.wait(timeout=left)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        log(f"budget spent during {model}: its compiles so far are kept")
        return False
    return True


def main() -> None:
    from redco_zoo_models.presets import PRESETS, PUBLISHED_PARAMS
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(sorted(PRESETS, key=PUBLISHED_PARAMS.get)))
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--lora_rank", type=int, default=16)
    parser.add_argument("--budget_minutes", type=float, default=60)
    parser.add_argument("--cache", default="family_table.json")
    parser.add_argument("--table_only", action="store_true", help="print the table from the "
                        "cache, compiling nothing")
    parser.add_argument("--states_only", action="store_true", help="build the models and "
                        "record only the cells their params and AdamW state decide (no compile)")
    parser.add_argument("--extrapolate", action="store_true", help="compile each layout at the "
                        "model's first 1-2 layers (bench/cut_decoders.py) and carry the peak to "
                        "full depth (bench/depth_rule.py); such cells are marked with a dagger")
    parser.add_argument("--scan_layers", action="store_true", help="the layers stacked and "
                        "scanned, every layout compiled at full depth (LoRA adapters stacked too)")
    parser.add_argument("--levers", default=",".join(LEVERS), help="the trainings to walk")
    parser.add_argument("--servers", default=",".join(HARDWARE), help="the hardware to walk")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    unknown = set(args.levers.split(",")) - set(LEVERS) | \
        set(args.servers.split(",")) - set(HARDWARE)
    if unknown:
        parser.error(f"unknown --levers/--servers {sorted(unknown)}: use {LEVERS}, "
                     f"{list(HARDWARE)}")
    if args.scan_layers and args.extrapolate:
        parser.error("--scan_layers compiles every layout at full depth: drop --extrapolate")
    from redco_planner.commands import simulate_devices
    simulate_devices(8)  # (the workers compile on them; here only the provenance names them)
    if args.worker:
        Worker(args.worker, args.seq_len, args.lora_rank, args.cache, args.extrapolate,
               args.scan_layers).run(args.states_only, args.levers.split(","),
                                     args.servers.split(","))
        return
    models = args.models.split(",")
    if not args.table_only:
        run_models(models, args)
    cache = json.loads(Path(args.cache).read_text()) if os.path.exists(args.cache) else {}
    sys.path.insert(0, str(HERE))
    from provenance import print_provenance
    print_provenance()
    labels = [label(m, args.scan_layers) for m in models]
    print(table(cache, labels, args.seq_len, args.lora_rank))
    print("\ncompile time per model (min): " + ", ".join(
        f"{m} {compile_minutes(cache, m):.0f}" for m in labels if compile_minutes(cache, m)))


if __name__ == "__main__":
    main()
