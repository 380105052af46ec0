"""The planner's pick for three published Mixture-of-Experts decoders on 8 x 80 GB and
2 x 8 x 80 GB (16 devices), and the collective bytes per step of the pick, read from its
compiled HLO, against a formula (issue 44 point 4).

**Models** (``redco_zoo_models.presets``): ``mixtral-8x7b`` (32 layers, 8 experts, top-2),
``qwen3-30b-a3b`` (48 layers, 128 experts, top-8), DeepSeek-V3-shaped: ``deepseek-v3``'s
layers (3 dense, then 256 routed experts, top-8, and a shared one; latent attention), 5 of its
61 (``LAYERS``). One row of ``--seq_len`` tokens per device, bf16
compute with fp32 params and AdamW state, remat ``--remat`` (one policy: the planner's walk
over policies would triple the compiles), the next-token loss of ``redco plan``.

**The walk** is the planner's own order (``redco_planner.planner``: ``split_degrees`` x
``with_expert_parallel``: at each mp = 1, 2, 4, ... ``auto``, ``auto+ep``, ``auto+fsdp+ep``,
``auto+fsdp``), the first layout that fits 90% of 80 GB is the pick. The state check is the
planner's (params and AdamW state per device from the shardings, no compile). What is not the
planner's: compiling 30 to 61 layers of these shapes on 2 shared CPU cores takes too long, so
each layout is compiled at two depths, ``d1`` and ``d1 + 1`` MoE layers (DeepSeek-V3's 3
dense layers kept), and carried to the full depth: the state exactly (each MoE layer adds the
same params), the collective bytes linearly, ``x(L) = x(d1) + (L - d1) (x(d1 + 1) - x(d1))``,
and the rest of the peak (temporaries) by ``depth_rule`` (its module docstring). The table says
which depths.

**The formula** (result bytes per device, as ``redco.hlo_collectives`` counts them), per
MoE layer and step: all-to-all ``a * E * C * H * 2`` (bf16 tokens), ``a`` all-to-alls (2
forward, 2 backward, 2 more when remat recomputes the forward), ``C = n`` dropless (this EP's
fixed buffer) or ``ceil(cf * n * k / E)`` with capacity factor cf, n = tokens per
data-parallel shard (``--seq_len``). It is checked against the measured growth from ``d1`` to
``d1 + 1`` layers (bytes and ops). XLA:CPU carries bf16 collectives in fp32 (the lowered
program's all_to_all is bf16, the compiled one f32), so on this machine the ratio is 2.00 where
the formula holds. The all-gathers (FSDP's) and all-reduces per step are given beside it.

**Capacity factor**: each cell is planned dropless (the presets' own) and with cf = 1.25. On
XLA:CPU a dropless MoE without EP runs ``jax.lax.ragged_dot``, which the CPU compiler lowers
to every row through every expert (its FLOPs and temporaries E times a grouped GEMM's), so
there the non-EP dropless peaks are the CPU's, not a GPU's; with cf = 1.25 both paths are the
same batched matmuls over (E, C, H) buffers.

Run:  nice -n 10 python bench/moe_plans.py [--models mixtral-8x7b,...] [--devices 8,16]
          [--factors dropless,1.25] [--seq_len 4096] [--budget_minutes 60]
          [--cache moe_plans.json] [--table_only]

Each cell (model, devices, capacity) runs in its own process, most devices first, until
``--budget_minutes`` is spent; the table says "not run" for the rest. A layout whose peak at
the first depth is already over the memory is not compiled at the second.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

from depth_rule import Compiled, extrapolate, layer_growth
from depth_rule import full_peak as full_peak_rule
from provenance import print_provenance

MODELS = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3")
# DeepSeek-V3-shaped: 5 of its 61 layers (3 dense, 2 MoE of 11.3B params each). Its full
# fp32 params and AdamW state, ~16 bytes x 671B, are 8x what 16 x 80 GB hold.
LAYERS = {"deepseek-v3": 5}
GB = 10 ** 9


def cell_key(model: str, devices: int, factor: float | None) -> str:
    return f"{model}|{devices}|{factor or 'dropless'}"


def plan_cell(model: str, n_devices: int, factor: float | None, args) -> dict:
    """The walk for one model, device count and capacity factor (module docstring)."""
    from redco.builtins.rules import has_experts
    from redco_planner.layouts import usable_bytes
    from redco_planner.planner import split_degrees, with_expert_parallel
    usable = usable_bytes(args.memory_gb * GB)
    builds = {depth: build(model, depth, factor, args.seq_len) for depth in depths(model)}
    params = next(iter(builds.values())).params
    rule_sets = with_expert_parallel(("auto", "auto+fsdp"), params)
    assert has_experts(params)
    tried = []
    for mp, _ in split_degrees(n_devices):
        for name in rule_sets:
            if name.endswith("+ep") and mp == n_devices:
                continue
            row = measure_layout(model, builds, n_devices, mp, name, usable, args)
            tried.append(row)
            print(f"  {model} {n_devices} dev cf={factor}: {summary(row)}", flush=True)
            if row.get("fits"):
                return {"pick": row, "tried": tried}
    return {"pick": None, "tried": tried}


def depths(model: str) -> tuple[int, int]:
    """The two depths compiled: 1 and 2 MoE layers (after DeepSeek-V3's 3 dense ones)."""
    from redco_zoo_models.presets import preset
    dense = preset(model).get("first_k_dense_replace", 0)
    return dense + 1, dense + 2


def full_depth(model: str) -> tuple[int, int]:
    """``(layers, MoE layers)`` planned for: the published model's, or ``LAYERS``'."""
    from redco_zoo_models.presets import preset
    config = preset(model)
    layers = LAYERS.get(model, config["num_hidden_layers"])
    return layers, layers - config.get("first_k_dense_replace", 0)


def preset_layers(model: str) -> int:
    from redco_zoo_models.presets import preset
    return preset(model)["num_hidden_layers"]


def build(model: str, layers: int, factor: float | None, seq_len: int):
    """The preset cut to ``layers``, with capacity factor ``factor``: a ``Model``."""
    import dataclasses

    from redco_planner.models import zoo_decoder
    from redco_zoo_models.decoder import DecoderConfig
    from redco_zoo_models.presets import preset
    cfg = DecoderConfig.from_hf({**preset(model), "num_hidden_layers": layers})
    return zoo_decoder(dataclasses.replace(cfg, capacity_factor=factor), seq_len)


def measure_layout(model: str, builds: dict, n_devices: int, mp: int, name: str, usable: int,
                   args) -> dict:
    """One layout: its state at full depth (no compile), then, if that fits, its compiled peak
    and collectives at both depths, extrapolated."""
    import jax.numpy as jnp

    from redco_planner.measure import measure
    row = {"mp": mp, "dp": n_devices // mp, "rules": name}
    (d1, m1), (d2, m2) = builds.items()
    total = full_depth(model)[1] - (d1 - depths(model)[0]) - 1  # MoE layers past the first
    layouts = {}
    try:
        for depth, built in builds.items():
            layouts[depth] = measure(built.params, built.loss_fn, built.batch(1), n_devices, mp,
                                     name, trace_fn=built.trace_fn, remat=args.remat,
                                     compute_dtype=jnp.bfloat16, skip_above=-1)
        row["state"] = extrapolate(layouts[d1].state_bytes, layouts[d2].state_bytes, total)
        if row["state"] > usable:
            return {**row, "fits": False, "over": "state"}
        start = time.perf_counter()
        for depth, built in builds.items():
            layouts[depth] = measure(built.params, built.loss_fn, built.batch(1), n_devices, mp,
                                     name, trace_fn=built.trace_fn, remat=args.remat,
                                     compute_dtype=jnp.bfloat16)
            if layouts[depth].peak_bytes > usable:  # (deeper holds more state)
                return {**row, "fits": False, "over": f"peak at {depth} layers",
                        "peak_at_depth": layouts[depth].peak_bytes,
                        "compile_s": time.perf_counter() - start}
        row["compile_s"] = time.perf_counter() - start
    except Exception as e:  # noqa: BLE001 - reported in the table, type and message
        return {**row, "error": f"{type(e).__name__}: {e}"[:300]}
    row["at_depths"] = [{"peak": layouts[d].peak_bytes, "state": layouts[d].state_bytes,
                         "collectives": layouts[d].collectives} for d in (d1, d2)]
    row["peak"] = full_peak(row, total)
    row["collectives"] = {
        kind: extrapolate(layouts[d1].collectives.get(kind, {}).get("bytes", 0),
                          layouts[d2].collectives.get(kind, {}).get("bytes", 0), total)
        for kind in set(layouts[d1].collectives) | set(layouts[d2].collectives)}
    row["fits"] = row["peak"] <= usable
    return row


def full_peak(row: dict, more_layers: int) -> int:
    """``depth_rule.full_peak`` from the row's two compiles, ``more_layers`` past the first
    MoE layer, the gradient floor a third of a layer's state (params + 2 AdamW moments). The
    measured growth alone is noise around that floor here (Qwen3-30B-A3B, 8 devices,
    auto+fsdp+ep: 11.1 GB beyond the state at 1 MoE layer, 10.3 at 2; 16 devices: 10.4, 11.7)."""
    one, two = (Compiled(d["peak"], d["state"]) for d in row["at_depths"])
    growth = layer_growth(one, two, (two.state - one.state) / 3)
    return full_peak_rule(row["state"], two, [(more_layers - 1, growth)])


def summary(row: dict) -> str:
    name = f"mp={row['mp']} dp={row['dp']} {row['rules']}"
    if "error" in row:
        return f"{name}: not measured ({row['error']})"
    if row.get("over") == "state":
        return f"{name}: state {row['state'] / GB:.1f} GB alone does not fit"
    if row.get("over"):
        return (f"{name}: {row['peak_at_depth'] / GB:.1f} GB {row['over']} does not fit, "
                f"compiled in {row['compile_s']:.0f}s")
    return (f"{name}: peak {row['peak'] / GB:.1f} GB ({'fits' if row['fits'] else 'no'}), "
            f"compiled in {row['compile_s']:.0f}s")


def formula_all_to_all(model: str, factor: float | None, seq_len: int, remat: str) -> int:
    """All-to-all result bytes per device, MoE layer and step (module docstring)."""
    from redco_zoo_models.presets import preset
    config = preset(model)
    experts = config.get("num_experts") or config.get("num_local_experts") or \
        config["n_routed_experts"]
    top_k = config["num_experts_per_tok"]
    capacity = seq_len if factor is None else math.ceil(factor * seq_len * top_k / experts)
    per_layer = 4 + (2 if remat != "none" else 0)
    return per_layer * experts * capacity * config["hidden_size"] * 2


def run_cell(key: str, args) -> None:
    """One cell (``model|devices|capacity``), in this process, written to the cache."""
    from redco_planner.commands import simulate_devices
    model, n_devices, factor = parse_key(key)
    simulate_devices(n_devices)
    start = time.perf_counter()
    result = plan_cell(model, n_devices, factor, args)
    result["minutes"] = (time.perf_counter() - start) / 60
    cache = load(args.cache)
    cache[key] = result
    with open(args.cache, "w") as f:
        json.dump(cache, f, indent=1)


def parse_key(key: str) -> tuple[str, int, float | None]:
    model, devices, factor = key.split("|")
    return model, int(devices), None if factor == "dropless" else float(factor)


def cells(args) -> list[str]:
    """Every cell, most devices first (their walks are shortest), then by model."""
    return [cell_key(model, n, factor) for n in sorted(args.devices, reverse=True)
            for factor in args.factors for model in args.models]


def load(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def table(args) -> str:
    """The markdown table of every cell in the cache."""
    cache = load(args.cache)
    lines = ["| model (layers) | devices | capacity | pick | peak / device | all-to-all per MoE "
             "layer: measured / formula | per step: all-to-all, all-gather, all-reduce |",
             "|---|---|---|---|---|---|---|"]
    for model in args.models:
        layers, moe = full_depth(model)
        for n_devices in args.devices:
            for factor in args.factors:
                result = cache.get(cell_key(model, n_devices, factor))
                lines.append(row_text(model, layers, n_devices, factor, result, args))
    return "\n".join(lines)


def row_text(model, layers, n_devices, factor, result, args) -> str:
    of = f" of {preset_layers(model)}" if layers != preset_layers(model) else ""
    head = (f"| {model} ({layers}{of}; compiled at {depths(model)[0]}, {depths(model)[1]}) | "
            f"{n_devices} x {args.memory_gb} GB | {factor or 'dropless'} | ")
    if result is None:
        return head + "not run (out of --budget_minutes) | | | |"
    pick = result["pick"]
    if pick is None:
        return head + f"nothing fits ({len(result['tried'])} layouts) | | | |"
    ep = f", ep={pick['dp']}" if pick["rules"].endswith("+ep") else ""
    more = full_depth(model)[1] - 1
    peak = full_peak(pick, more)
    fits = "" if peak <= 0.9 * args.memory_gb * GB else " (over 90%: does not fit)"
    one, two = (d["collectives"].get("all-to-all", {}) for d in pick["at_depths"])
    measured = two.get("bytes", 0) - one.get("bytes", 0)
    formula = formula_all_to_all(model, factor, args.seq_len, args.remat) if ep else 0
    per_layer = (f"{measured / GB:.2f} / {formula / GB:.2f} GB ({measured / formula:.2f}x, "
                 f"{two.get('ops', 0) - one.get('ops', 0)} ops)") if formula else "-"
    coll = pick["collectives"]
    return (head + f"mp={pick['mp']} dp={pick['dp']} {pick['rules']}{ep} | "
            f"{peak / GB:.1f} GB{fits} | {per_layer} | " + ", ".join(
                f"{coll.get(kind, 0) / GB:.1f}" for kind in ("all-to-all", "all-gather",
                                                              "all-reduce")) + " GB |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--devices", default="8,16")
    parser.add_argument("--memory_gb", type=int, default=80)
    parser.add_argument("--seq_len", type=int, default=4096)
    parser.add_argument("--remat", default="full")
    parser.add_argument("--budget_minutes", type=float, default=60)
    parser.add_argument("--cache", default="moe_plans.json")
    parser.add_argument("--table_only", action="store_true")
    parser.add_argument("--factors", default="dropless,1.25",
                        help="capacity factors, each a column: dropless and/or numbers")
    parser.add_argument("--one_cell", help=argparse.SUPPRESS)  # the child process's cell
    args = parser.parse_args()
    args.models = args.models.split(",")
    args.devices = [int(d) for d in args.devices.split(",")]
    args.factors = [None if f == "dropless" else float(f) for f in args.factors.split(",")]
    if args.one_cell:
        return run_cell(args.one_cell, args)
    if not args.table_only:
        deadline = time.time() + 60 * args.budget_minutes
        for key in cells(args):
            left = deadline - time.time()
            if left <= 0:
                break
            if key in load(args.cache):
                continue
            try:  # (each cell in its own process: XLA:CPU's compile memory is freed)
                subprocess.run([sys.executable, __file__, "--one_cell", key, *sys.argv[1:]],
                               timeout=left, check=False)
            except subprocess.TimeoutExpired:
                print(f"{key}: stopped at --budget_minutes", flush=True)
    from redco_planner.commands import simulate_devices
    simulate_devices(max(args.devices))  # (for the machine line: the devices compiled on)
    print_provenance()
    print(f"seq {args.seq_len} tokens x 1 row per device, bf16 compute, fp32 params + AdamW, "
          f"remat={args.remat}")
    print(table(args))


if __name__ == "__main__":
    main()
