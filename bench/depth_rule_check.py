"""Checks ``depth_rule`` where the full depth is cheap to compile: for a few (model, training,
layout, remat) cases of the small published decoders on 8 simulated devices, the step compiled
at full depth against the peak carried from its cuts (``cut_decoders``), and their ratio.

Run:  nice -n 10 python bench/depth_rule_check.py [--seq_len 2048] [--cache depth_check.json]
Each case is kept in ``--cache`` as it completes, so a run resumes; a case whose cuts are not
``cut_decoders``' (its ``BASE`` changed) compiles its cuts again and keeps its full compile.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

GiB = 1024 ** 3
CASES = (  # (model, training, mp, rules, remat): the 8 x 16 GB walk's layouts
    ("qwen3-0.6b", "full", 1, "auto+fsdp", "full"),
    ("qwen3-0.6b", "full", 1, "auto+fsdp", "none"),
    ("gemma-3-1b", "full", 1, "auto+fsdp", "none"),
    ("llama-3.2-1b", "LoRA", 1, "auto", "full"),
    ("llama-3.2-1b", "full", 2, "auto", "none"),
    ("gemma-3-1b", "LoRA", 1, "auto+fsdp", "full"),
)


def check(case: tuple, seq_len: int, rank: int, known: dict | None) -> dict:
    """The case compiled at its cuts and at full depth (the full compile reused from ``known``,
    an earlier result of the case): both peaks (bytes) and compile times."""
    import jax.numpy as jnp
    from cut_decoders import compile_cuts, extrapolated_peak
    from family_table import lever_parts
    name, lever, mp, rules, remat = case
    parts = lambda model: lever_parts(model, lever, rank)  # noqa: E731
    start = time.perf_counter()
    cuts = compile_cuts(name, seq_len, parts, 8, (mp, rules, remat), 2 ** 62, jnp.bfloat16)
    full = known or full_depth(case, seq_len, parts)
    return {**full, "cuts": cuts, "extrapolated": extrapolated_peak(name, full["state"], cuts),
            "cut_s": round(time.perf_counter() - start)}


def full_depth(case: tuple, seq_len: int, parts) -> dict:
    """The case's step compiled at the model's full depth."""
    import jax.numpy as jnp
    import optax

    from redco.sharding import dataflow_trace
    from redco_planner.inspection import load_model
    from redco_planner.search import try_layout
    name, lever, mp, rules, remat = case
    start = time.perf_counter()
    model = load_model(name, seq_len=seq_len)
    params, loss, trainable, _ = parts(model)  # (full and LoRA: no overrides)
    batch = model.batch(1)
    layout = try_layout(params, loss, batch, 8, mp, rules, optax.adamw,
                        dataflow_trace(loss, batch), remat, trainable, 2 ** 62,
                        compute_dtype=jnp.bfloat16)
    if layout.error:
        raise RuntimeError(f"{case}: the full-depth compile failed: {layout.error}")
    return {"compiled": layout.peak_bytes, "state": layout.state_bytes,
            "full_s": round(time.perf_counter() - start)}


def cut_names(name: str) -> set[str]:
    from cut_decoders import cut_kinds
    return {",".join(kinds) for kinds in cut_kinds(name)}


def table(results: dict) -> str:
    lines = ["| model | training | layout | remat | compiled full depth | extrapolated | "
             "extrapolated - compiled | compile s: cuts, full |",
             "|---|---|---|---|---:|---:|---:|---|"]
    for case in CASES:
        r = results.get("|".join(map(str, case)))
        if r is None:
            continue
        name, lever, mp, rules, remat = case
        lines.append(f"| {name} | {lever} | mp={mp} {rules} | {remat} | "
                     f"{r['compiled'] / GiB:.2f} GiB | {r['extrapolated'] / GiB:.2f} GiB | "
                     f"{r['extrapolated'] - r['compiled']:+,} B "
                     f"({r['extrapolated'] / r['compiled'] - 1:+.2%}) | {r['cut_s']}, {r['full_s']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--lora_rank", type=int, default=16)
    parser.add_argument("--cache", default="depth_check.json")
    parser.add_argument("--table_only", action="store_true")
    args = parser.parse_args()
    from redco_planner.commands import simulate_devices
    simulate_devices(8)
    path = Path(args.cache)
    results = json.loads(path.read_text()) if os.path.exists(path) else {}
    for case in CASES if not args.table_only else ():
        k = "|".join(map(str, case))
        if k not in results or set(results[k]["cuts"]) != cut_names(case[0]):
            known = {f: results[k][f] for f in ("compiled", "state", "full_s")} \
                if k in results else None
            results[k] = check(case, args.seq_len, args.lora_rank, known)
            path.write_text(json.dumps(results, indent=1))
            print(k, results[k], flush=True)
    from provenance import print_provenance
    print_provenance()
    print(table(results))


if __name__ == "__main__":
    main()
