"""The planner's quantised-base lever on the servers of issue 64 (BENCHMARKS.md section 39): for
each model and server, the planner's walk of stages (full fine-tuning, LoRA over the fp32 base,
LoRA over an int8 base, LoRA over an NF4 base: ``redco_planner.planner.plan`` with
``quantize_base="auto"``), each stage's layouts (``n_model_shards`` 1, 2, ...; ``auto`` then
``auto+fsdp``; remat ``none``, ``dots_saveable``, ``full``) until one fits 90% of the memory.

Each layout is measured as ``bench/family_table.py`` measures it (its ``Worker``: one row of
``--seq_len`` tokens per device, bf16 compute, fp32 params and AdamW state, LoRA rank
``--lora_rank`` on the attention and MLP projections; a layout whose params and optimizer
state alone exceed the memory is not compiled), the quantised stages with the projections as
``QuantizedLinear`` codes and scales (``redco_planner.models.zoo_decoder``'s
``quantized``). Each step is unrolled and compiled at the model's first 3 and 4 layers
(Gemma 3: and a global layer), its peak carried to full depth by ``bench/depth_rule.py``
(``--extrapolate`` there; cells marked with a dagger); with ``--scan_layers`` each is compiled at
full depth with its layers stacked and scanned (QLoRA's codes and scales stacked too), in a
compile time that does not grow with depth, its cells the scanned step's own peaks (kept in the
cache under ``<model> scanned``, ``family_table.label``).

Each model runs in its own process, smallest first, until ``--budget_minutes`` is spent; a
stage whose walk did not finish is "not run". ``--cache`` keeps every compile.

Run:  nice -n 10 python bench/qlora_plans.py [--budget_minutes 35] [--cache qlora_plans.json]
          [--scan_layers] [--table_only]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from family_table import (
    QUANTIZED,
    GiB,
    Worker,
    candidates,
    describe,
    key,
    label,
    lever_parts,
    log,
    total_state_bytes,
    usable,
    walk,
    with_extrapolation,
    within_budget,
)

SERVERS = {"1 x 80 GB": (1, 80 * GiB), "2 x 80 GB": (2, 80 * GiB), "8 x 16 GB": (8, 16 * GiB),
           "1 x 48 GB": (1, 48 * GiB), "1 x 16 GB": (1, 16 * GiB)}
ROWS = {"llama-3.1-8b": ("1 x 16 GB",), "gemma-3-27b": ("8 x 16 GB", "1 x 48 GB"),
        "qwen3-32b": ("8 x 16 GB", "1 x 48 GB"), "llama-3.1-70b": ("1 x 80 GB", "2 x 80 GB")}
STAGES = ("full", "LoRA", *QUANTIZED)  # the planner's order under quantize_base="auto"


def stage_result(cache: dict, model: str, stage: str, server: str, entry=None) -> dict:
    """One stage's walk on ``server``: from ``entry`` (measuring what the cache lacks) or, with
    none, replayed from the cache alone."""
    from redco_planner.planner import REMAT_POLICIES
    n, memory = SERVERS[server]
    state = cache.get(f"{model}|{stage}|state")
    if state is None:
        return {"incomplete": stage}
    if state["bytes"] / n > usable(memory):
        return {"state_only": True, "floor": state["bytes"] / n}

    def cached(cand, limit):
        found = cache.get(key(model, stage, n, cand))
        if found is None or not ({"peak", "cuts"} & set(found) or found["floor"] > limit):
            return None
        return with_extrapolation(model, found)
    return walk(candidates(n, list(REMAT_POLICIES)), usable(memory), entry or cached)


def run_worker(model: str, args: argparse.Namespace) -> None:
    """Every server of ``model``'s row, stage by stage until one fits (compiling what the cache
    lacks, at the cuts)."""
    import jax.numpy as jnp
    import optax

    from redco.sharding import dataflow_trace
    worker = Worker(model, args.seq_len, args.lora_rank, args.cache,
                    extrapolate=not args.scan_layers, scan_layers=args.scan_layers)
    name, left = worker.name, list(ROWS[model])
    for stage in STAGES:
        if not left:
            return
        params, loss, trainable, overrides = lever_parts(worker.model, stage, args.lora_rank)
        worker.save(f"{name}|{stage}|state", {"bytes": total_state_bytes(params, trainable)})
        trace_fn = dataflow_trace(loss, worker.batch)
        for server in list(left):
            n, memory = SERVERS[server]
            ctx = dict(lever=stage, params=params, loss=loss, trainable=trainable,
                       trace_fn=trace_fn, n=n, compute_dtype=jnp.bfloat16,
                       optimizer=optax.adamw, overrides=overrides)
            result = stage_result(worker.load(), name, stage, server,
                                  lambda cand, limit: worker.entry(cand, limit, ctx))
            log(f"{name} {stage} {server}: {describe(result)}")
            if result.get("pick"):
                left.remove(server)


def table(cache: dict, scan_layers: bool) -> str:
    lines = ["| model | server | " + " | ".join(STAGES) + " | the planner's pick |",
             "|---|---|" + "---|" * (len(STAGES) + 1)]
    for model, servers in ROWS.items():
        model = label(model, scan_layers)
        for server in servers:
            cells, pick = [], "nothing fits"
            for stage in STAGES:
                if pick != "nothing fits":
                    cells.append("not run" if pick == "not run" else
                                 "not tried (an earlier stage fits)")
                    continue
                result = stage_result(cache, model, stage, server)
                cells.append(describe(result))
                if "incomplete" in result:
                    pick = "not run"
                elif result.get("pick"):
                    pick = stage
            lines.append(f"| {model} | {server} | " + " | ".join(cells) + f" | {pick} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--lora_rank", type=int, default=16)
    parser.add_argument("--budget_minutes", type=float, default=35)
    parser.add_argument("--cache", default="qlora_plans.json")
    parser.add_argument("--table_only", action="store_true")
    parser.add_argument("--scan_layers", action="store_true", help="every layout compiled at "
                        "full depth, the layers stacked and scanned (no cuts, no depth rule)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    from redco_planner.commands import simulate_devices
    simulate_devices(8)
    if args.worker:
        return run_worker(args.worker, args)
    deadline = time.time() + 60 * args.budget_minutes
    for model in ([] if args.table_only else ROWS):
        left = deadline - time.time()
        if left <= 0:
            log(f"budget spent: {model} and the models after it not run")
            break
        if not within_budget([sys.executable, __file__, "--worker", model, "--seq_len",
                              str(args.seq_len), "--lora_rank", str(args.lora_rank), "--cache",
                              args.cache, *["--scan_layers"] * args.scan_layers], model, left):
            break
    cache = json.loads(Path(args.cache).read_text()) if os.path.exists(args.cache) else {}
    from provenance import print_provenance
    print_provenance()
    how = ("the layers stacked and scanned, every layout compiled at full depth" if
           args.scan_layers else "† carried from cuts of 3 and 4 layers by the depth rule")
    print(f"seq_len {args.seq_len}, one row per device, bf16 compute, fp32 params and AdamW; "
          f"LoRA rank {args.lora_rank}; a layout fits at 90% of the memory; {how}")
    print(table(cache, args.scan_layers))


if __name__ == "__main__":
    main()
