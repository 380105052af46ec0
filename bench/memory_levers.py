"""Which memory lever makes a big model fit, and at what layout: per-device peak memory of the
train step, read off XLA's ``memory_analysis()`` of the step compiled ahead of time on abstract
shapes (nothing is allocated), with the layout the planner picks for each lever.

Levers, each planned by ``redco_planner.planner.plan`` (model-parallel degree from the smallest,
``auto`` then ``auto+fsdp``, remat policies least recompute first; the first that fits 90% of
the memory is the pick):

  full          every param trained, fp32 params and AdamW, no remat
  full + remat  the same, remat policies ``dots_saveable`` then ``full``
  LoRA          the zoo's native LoRA layers (``redco_zoo_models.add_lora``, rank ``--lora_rank``):
                the base frozen, no gradient or optimizer state for it (``plan(trainable=...)``)
  LoRA + remat  LoRA with ``dots_saveable`` then ``full``

For each device count, each lever is planned at the smallest memory (stopping at its first fit,
as ``plan`` does); a larger memory's pick is the first of those same candidates that fits it,
plan's own rule, so nothing is compiled twice. Then, on one device of ``--largest_on``, the most
layers of ``--preset``'s width that fit for each lever (the remat levers with ``full`` remat, the
least memory), found by a few compiles (``most_layers``).

    python bench/memory_levers.py [--preset llama-7b --seq_len 2048 --devices 4,8 \\
        --memory 40GB,80GB --largest_on 80GB]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

LEVERS = {"full": (False, ("none",)), "full + remat": (False, ("dots_saveable", "full")),
          "LoRA": (True, ("none",)), "LoRA + remat": (True, ("dots_saveable", "full"))}


def first_fit(tried: list, memory: int):
    """``plan``'s pick among ``tried`` (in its order) for ``memory``: the first that fits."""
    from redco_planner.layouts import usable_bytes
    return next((t for t in tried if t.peak_bytes is not None
                 and t.peak_bytes <= usable_bytes(memory)), None)


def compile_skipped(layout, params, loss, batch, trainable, memory: int):
    """``layout``, compiled if ``plan`` skipped it for its state alone at the smallest memory
    and that state is within ``memory``'s usable bytes (it may fit there)."""
    from redco.sharding import dataflow_trace
    from redco_planner.layouts import usable_bytes
    from redco_planner.measure import measure
    if layout.over_budget is None or layout.state_bytes > usable_bytes(memory):
        return layout
    return measure(params, loss, batch, layout.n_devices, layout.n_model_shards,
                   layout.sharding_rules, trace_fn=dataflow_trace(loss, batch),
                   remat=layout.remat, trainable=trainable)


def lever_model(model, use_lora: bool, rank: int):
    """``(params, loss, trainable mask)`` of ``model`` with or without its native LoRA layers."""
    from redco import lora
    if not use_lora:
        return model.params, model.loss_fn, None
    adapters = model.lora(rank)
    return adapters.params, adapters.loss, lora.trainable_mask(adapters.params)


def plan_levers(model, batch, n_devices: int, memories: list[int], rank: int) -> list[tuple]:
    """Rows ``(lever, memory, pick or None, seconds)`` for ``n_devices``."""
    from redco_planner.planner import PlanError, plan
    rows = []
    for lever, (use_lora, policies) in LEVERS.items():
        params, loss, trainable = lever_model(model, use_lora, rank)
        start = time.perf_counter()
        try:
            tried = plan(params, loss, batch, n_devices, min(memories), remat_policies=policies,
                         trainable=trainable, log=lambda line: print("   ", line, flush=True)).tried
        except PlanError as e:
            tried = e.tried
        tried = [compile_skipped(t, params, loss, batch, trainable, max(memories)) for t in tried]
        seconds = time.perf_counter() - start
        for memory in memories:
            rows.append((lever, memory, first_fit(tried, memory), seconds))
    return rows


def most_layers(preset: dict, seq_len: int, memory: int, use_lora: bool, policy: str,
                rank: int) -> tuple[int, int]:
    """The most layers of ``preset``'s width whose step fits one device of ``memory`` (0 if
    one layer does not), and its peak.

    Peak memory grows about linearly with layers, so each next guess is where the line through
    the two nearest compiled points reaches the limit, kept between the most layers known to
    fit and the fewest known not to, until those two are one layer apart."""
    from redco_planner.layouts import usable_bytes
    from redco_planner.measure import measure
    from redco_planner.models import zoo_llama
    usable, seen = usable_bytes(memory), {}

    def peak(layers: int) -> int:
        if layers not in seen:
            model = zoo_llama(seq_len, **{**preset, "num_hidden_layers": layers})
            params, loss, trainable = lever_model(model, use_lora, rank)
            seen[layers] = measure(params, loss, model.batch(1), 1, 1, remat=policy,
                                   trainable=trainable).peak_bytes
            print(f"    {layers} layers: peak {seen[layers] / 2**30:.2f} GiB", flush=True)
        return seen[layers]

    peak(1), peak(2)
    while True:
        fit = max((n for n, p in seen.items() if p <= usable), default=0)
        over = min((n for n, p in seen.items() if p > usable), default=None)
        if over is not None and over - fit == 1:
            return fit, seen.get(fit, 0)
        a, b = (fit, over) if over is not None and fit else sorted(seen)[-2:]
        guess = a + int((usable - peak(a)) * (b - a) // (peak(b) - peak(a)))
        peak(max(fit + 1, min(guess, over - 1)) if over is not None else max(fit + 1, guess))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-7b")
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--devices", default="4,8")
    parser.add_argument("--memory", default="40GB,80GB", help="per device, GiB as GPUs quote it")
    parser.add_argument("--largest_on", default="80GB", help="one device of this much, or none")
    parser.add_argument("--lora_rank", type=int, default=8)
    args = parser.parse_args()
    device_counts = [int(n) for n in args.devices.split(",")]
    from redco_planner.commands import simulate_devices
    simulate_devices(max(device_counts + [1]))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import jax
    from provenance import print_provenance

    from redco_planner.inspection import human_bytes, parse_bytes
    from redco_planner.models import zoo_llama
    from redco_zoo_models import LLAMA_PRESETS
    print_provenance()
    memories = sorted(parse_bytes(m) for m in args.memory.split(","))
    preset = LLAMA_PRESETS[args.preset]
    model = zoo_llama(args.seq_len, **preset)
    rows = []
    for n in device_counts:
        print(f"{n} devices:", flush=True)
        rows += [(n, *row) for row in plan_levers(model, model.batch(1), n, memories,
                                                  args.lora_rank)]
    print(f"\n{args.preset}, one row of {args.seq_len} tokens per device, fp32 params, AdamW; "
          f"LoRA rank {args.lora_rank}; the planner's pick per lever\n"
          "| devices | memory | lever | pick: mp, rules, remat | peak per device | of memory "
          "| FLOPs per device | planned in |\n|---:|---:|---|---|---:|---:|---:|---:|")
    for n, lever, memory, pick, seconds in rows:
        name = human_bytes(memory).replace(".00 ", " ")
        if pick is None:
            print(f"| {n} | {name} | {lever} | nothing fits | | | | {seconds:.0f} s |")
            continue
        print(f"| {n} | {name} | {lever} | mp={pick.n_model_shards}, {pick.sharding_rules}, "
              f"{pick.remat} | {human_bytes(pick.peak_bytes)} | {pick.peak_bytes / memory:.0%} | "
              f"{pick.flops:.3g} | {seconds:.0f} s |")
    if args.largest_on.lower() == "none":
        return
    memory = parse_bytes(args.largest_on)
    largest = []
    for lever, (use_lora, policies) in LEVERS.items():
        print(f"{lever}, one device of {args.largest_on}:", flush=True)
        largest.append((lever, policies[-1], *most_layers(
            preset, args.seq_len, memory, use_lora, policies[-1], args.lora_rank)))
    print(f"\nThe most layers of {args.preset}'s width (hidden {preset['hidden_size']}, SwiGLU "
          f"{preset['intermediate_size']}) whose train step fits one device of "
          f"{args.largest_on} (90% of it), one row of {args.seq_len} tokens\n"
          "| lever | remat | layers | params | peak |\n|---|---|---:|---:|---:|")
    for lever, policy, layers, peak in largest:
        n_params = sum(x.size for x in jax.tree.leaves(
            zoo_llama(args.seq_len, **{**preset, "num_hidden_layers": layers}).params))
        print(f"| {lever} | {policy} | {layers} | {n_params / 1e9:.2f}B | {human_bytes(peak)} |")


if __name__ == "__main__":
    main()
