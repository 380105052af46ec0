"""The paper's Table 1 ("runnable model finetuning on different servers"), by ahead-of-time
compilation on abstract shapes.

For every model of the table, with its published configuration, at the paper's maximum length,
per-device batch 1, float32 params and ``optax.adamw``: the whole train step (forward,
backward, AdamW update, state donated) is compiled for the row's device count and its
per-device peak read off XLA's buffer assignment by ``redco_planner.planner.measure`` (arguments +
outputs - donated aliases + temporaries; activations are in the temporaries). Nothing is
allocated, so a 66B model costs only compile time. Two layouts per model:

* ``auto`` with ``n_model_shards`` = the device count (pure tensor parallelism, as the paper
  ran), and
* ``auto+fsdp`` at every ``n_model_shards`` dividing the device count; the best (lowest peak).
  A layout with more than ``--max-full-dp`` (8) data-parallel devices is not compiled at full
  depth (XLA:CPU's compile time and memory grow with dp x layers: OPT-66B at dp = 64 ran for
  more than 9 minutes and 17 GB before it was stopped); its peak is extrapolated from a line
  through 2 and 4 layers, checked at 6, and printed as EXTRAPOLATED (``~N*`` in the table).

Then, per row, the largest model of one family its hardware fits with ``auto+fsdp``: the
family's next size up (GPT-2 XL, LLaMA-13B, OPT-30B, OPT-175B) with its layer count searched:
two small compiles per ``n_model_shards`` (a line in the layer count) pick the layout and the
first guess, and a bisection of real compiles settles the largest layer count that fits (the
answer is measured at L and L + 1, never extrapolated).

Each row runs in its own process with ``XLA_FLAGS=--xla_force_host_platform_device_count=N``
(N = the row's devices). The models come from ``tests/sharding_hf/hf_archs.py`` (HuggingFace
transformers 4.57 Flax classes built with ``_do_init=False``).

CPU buffer assignment is a proxy for a GPU's or TPU's: XLA:CPU fuses and schedules
differently and does not rematerialise, and a real device also holds the runtime's own
reservations (CUDA context, XLA's allocator), so a peak within a few percent of the memory is
a marginal fit.

Run:  python bench/table1.py [--rows 1080ti,a100,tpu8,tpu64] [--models opt-13b,...]
                              [--quick] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GiB = 1024 ** 3

# ---- the published configurations --------------------------------------------------------------
# name -> (hf_archs arch, transformers config fields, nominal size, the config it follows).
# Every field that differs from hf_archs' tiny defaults is written out.
CONFIGS = {
    "bart-large": ("bart", dict(
        vocab_size=50265, d_model=1024, encoder_layers=12, decoder_layers=12,
        encoder_attention_heads=16, decoder_attention_heads=16, encoder_ffn_dim=4096,
        decoder_ffn_dim=4096, max_position_embeddings=1024, activation_function="gelu",
        scale_embedding=False, tie_word_embeddings=True), 406e6, "facebook/bart-large"),
    "gpt2-large": ("gpt2", dict(
        vocab_size=50257, n_positions=1024, n_embd=1280, n_layer=36, n_head=20, n_inner=None,
        activation_function="gelu_new", tie_word_embeddings=True), 774e6, "gpt2-large"),
    "gpt2-xl": ("gpt2", dict(
        vocab_size=50257, n_positions=1024, n_embd=1600, n_layer=48, n_head=25, n_inner=None,
        activation_function="gelu_new", tie_word_embeddings=True), 1.558e9, "gpt2-xl"),
    "llama-7b": ("llama", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=2048,
        rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False), 6.7e9,
        "LLaMA-7B (Touvron et al. 2023, Table 2)"),
    "llama-13b": ("llama", dict(
        vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
        num_attention_heads=40, num_key_value_heads=40, max_position_embeddings=2048,
        rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False), 13.0e9,
        "LLaMA-13B"),
    "gpt-j-6b": ("gptj", dict(
        vocab_size=50400, n_positions=2048, n_embd=4096, n_layer=28, n_head=16, rotary_dim=64,
        n_inner=None, activation_function="gelu_new", tie_word_embeddings=False), 6.053e9,
        "EleutherAI/gpt-j-6b"),
    # "T5-XXL-11B": the paper names T5-XXL and cites Raffel et al.'s T5-11B; the two are
    # different 11B networks, so both are measured. t5-v1_1-xxl is also flan-t5-xxl's
    # architecture (Redco's seq2seq example uses the flan-t5 family).
    "t5-v1_1-xxl": ("t5", dict(
        vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24,
        num_decoder_layers=24, num_heads=64, relative_attention_num_buckets=32,
        relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
        tie_word_embeddings=False), 11e9, "google/t5-v1_1-xxl (= flan-t5-xxl)"),
    "t5-11b": ("t5", dict(
        vocab_size=32128, d_model=1024, d_kv=128, d_ff=65536, num_layers=24,
        num_decoder_layers=24, num_heads=128, relative_attention_num_buckets=32,
        relative_attention_max_distance=128, feed_forward_proj="relu",
        tie_word_embeddings=True), 11e9, "t5-11b (Raffel et al. 2020)"),
    **{name: ("opt", dict(
        vocab_size=50272, hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads,
        ffn_dim=4 * d, word_embed_proj_dim=d, max_position_embeddings=2048,
        do_layer_norm_before=True, activation_function="relu", tie_word_embeddings=True),
        size, f"facebook/{name} (Zhang et al. 2022, Table 1)")
       for name, d, layers, heads, size in [("opt-13b", 5120, 40, 40, 13e9),
                                            ("opt-30b", 7168, 48, 56, 30e9),
                                            ("opt-66b", 9216, 64, 72, 66e9),
                                            ("opt-175b", 12288, 96, 96, 175e9)]},
}
LAYERS_FIELDS = {"gpt2": ("n_layer",), "gptj": ("n_layer",), "llama": ("num_hidden_layers",),
                 "opt": ("num_hidden_layers",), "t5": ("num_layers", "num_decoder_layers"),
                 "bart": ("encoder_layers", "decoder_layers")}


def with_layers(name: str, layers: int) -> dict:
    """Config overrides giving ``name`` this many layers (in each stack of an encoder-decoder)."""
    return {field: layers for field in LAYERS_FIELDS[CONFIGS[name][0]]}


def full_layers(name: str) -> int:
    return CONFIGS[name][1][LAYERS_FIELDS[CONFIGS[name][0]][0]]

# ---- the table's rows ----------------------------------------------------------------------
# models: (config name, max length). The extracted table reads "BART-Large (1024) GPT2-Large
# (512)" but the text says BART at 512 and GPT-2 at 1024; the text's reading comes first, the
# literal one is measured too (marked "table literal").
ROWS = {
    "1080ti": dict(server="2 x 1080Ti", devices=2, memory_gib=10,
                   models=[("bart-large", 512), ("gpt2-large", 1024),
                           ("bart-large", 1024), ("gpt2-large", 512)],
                   family=("gpt2-xl", 1024)),
    "a100": dict(server="4 x A100", devices=4, memory_gib=40,
                 models=[("llama-7b", 1024), ("gpt-j-6b", 1024)],
                 family=("llama-13b", 1024)),
    "tpu8": dict(server="2 hosts x 4 TPU-v4", devices=8, memory_gib=32,
                 models=[("t5-v1_1-xxl", 512), ("t5-11b", 512), ("opt-13b", 1024)],
                 family=("opt-30b", 1024)),
    "tpu64": dict(server="16 hosts x 4 TPU-v4", devices=64, memory_gib=32,
                  models=[("opt-66b", 512)],
                  family=("opt-175b", 512)),
}
PAPER_LENGTH = {("bart-large", 1024): "table literal", ("gpt2-large", 512): "table literal"}


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


# ---- one row, in a process that sees the row's device count ----------------------------------
def build(name: str, seq_len: int, **overrides):
    sys.path.insert(0, str(REPO / "tests" / "sharding_hf"))
    import hf_archs
    arch, fields, _, _ = CONFIGS[name]
    return hf_archs.build(arch, abstract=True, seq_len=seq_len, **{**fields, **overrides})


def n_params(model) -> int:
    import jax
    return sum(int(x.size) for x in jax.tree.leaves(model.params))


def measure(model, devices: int, mp: int, rules: str) -> dict:
    """One AOT compile; the layout's numbers as a dict (peak None and an error if it failed)."""
    from redco.sharding import dataflow_trace
    from redco_planner.measure import measure as planner_measure
    batch = model.abstract_batch(1)
    start = time.perf_counter()
    try:
        layout = planner_measure(model.params, model.loss_fn, batch, devices, mp, rules,
                                 trace_fn=dataflow_trace(model.loss_fn, batch))
        out = dict(rules=rules, mp=mp, dp=devices // mp, peak=layout.peak_bytes,
                   params_per_device=layout.params_bytes, argument=layout.argument_bytes,
                   output=layout.output_bytes, alias=layout.alias_bytes, temp=layout.temp_bytes,
                   compile_s=round(layout.compile_s, 1), error=None)
    except Exception as e:  # noqa: BLE001 - a layout that does not compile is reported
        out = dict(rules=rules, mp=mp, dp=devices // mp, peak=None, error=f"{type(e).__name__}: "
                   f"{e}"[:300])
    out["wall_s"] = round(time.perf_counter() - start, 1)
    return out


def describe(m: dict, memory: int) -> str:
    head = f"{m['rules']:<9} mp={m['mp']:<2} dp={m['dp']:<2}"
    if m.get("extrapolated"):
        return (f"{head} EXTRAPOLATED peak {gib(m['extrapolated_peak'])} GiB at "
                f"{m['full_layers']} layers (line through {m['points'][0][0]} and "
                f"{m['points'][1][0]} layers, off by {m['check_error'] / GiB:+.2f} GiB at "
                f"{m['points'][2][0]}); not compiled at full size: dp > --max-full-dp")
    if m["peak"] is None:
        return f"{head} failed: {m['error']}"
    return (f"{head} peak {gib(m['peak']):>6} GiB (params {gib(m['params_per_device'])}, temp "
            f"{gib(m['temp'])}) {'fits' if m['peak'] <= memory else 'does not fit'}; "
            f"{m['wall_s']:.0f}s")


def line(points: list[tuple[int, int]]) -> tuple[float, float]:
    """(intercept, slope) of peak bytes in the layer count, through the first two points."""
    (l1, p1), (l2, p2) = points[:2]
    slope = (p2 - p1) / (l2 - l1)
    return p1 - slope * l1, slope


def extrapolate(name: str, seq_len: int, devices: int, mp: int,
                layers: tuple[int, ...] = (2, 4, 6)) -> dict:
    """A layout too slow to compile at full depth here (dp > --max-full-dp): its peak from a
    line in the layer count through two small compiles, checked on a third. Labelled."""
    start = time.perf_counter()
    points = []
    for n in layers:
        m = measure(build(name, seq_len, **with_layers(name, n)), devices, mp, "auto+fsdp")
        if m["peak"] is None:
            return {**m, "wall_s": round(time.perf_counter() - start, 1)}
        points.append((n, m["peak"]))
    intercept, slope = line(points)
    check = points[2][1] - (intercept + slope * points[2][0])
    return dict(rules="auto+fsdp", mp=mp, dp=devices // mp, peak=None, error=None,
                extrapolated=True, full_layers=full_layers(name), points=points,
                check_error=check, extrapolated_peak=intercept + slope * full_layers(name),
                wall_s=round(time.perf_counter() - start, 1))


def run_model(name: str, seq_len: int, row: dict, quick: bool, max_full_dp: int) -> dict:
    from redco_planner.planner import model_shard_degrees
    devices, memory = row["devices"], row["memory_gib"] * GiB
    start = time.perf_counter()
    model = build(name, seq_len)
    count = n_params(model)
    log(f"[{row['server']}] {name} ({seq_len}): {count:,} params "
        f"({count / CONFIGS[name][2]:.3f}x the nominal {CONFIGS[name][2] / 1e9:g}B)")
    auto = measure(model, devices, devices, "auto")
    log("  " + describe(auto, memory))
    fsdp = []
    for mp in ([1] if quick else model_shard_degrees(devices)):
        if mp == devices:  # dp = 1: auto+fsdp adds nothing to auto
            fsdp.append({**auto, "rules": "auto+fsdp", "same_as_auto": True})
            continue
        if devices // mp > max_full_dp:
            fsdp.append(extrapolate(name, seq_len, devices, mp))
        else:
            fsdp.append(measure(model, devices, mp, "auto+fsdp"))
        log("  " + describe(fsdp[-1], memory))
    ok = [m for m in fsdp if m["peak"] is not None]  # measured, not extrapolated
    best = min(ok, key=lambda m: m["peak"]) if ok else None
    return dict(model=name, seq_len=seq_len, params=count, nominal=CONFIGS[name][2],
                source=CONFIGS[name][3], note=PAPER_LENGTH.get((name, seq_len), ""),
                auto=auto, fsdp=fsdp, best_fsdp=best,
                fits_auto=auto["peak"] is not None and auto["peak"] <= memory,
                fits_fsdp=best is not None and best["peak"] <= memory,
                wall_s=round(time.perf_counter() - start, 1))


def largest(row: dict, max_full_dp: int, points: tuple[int, int] = (4, 8),
            max_probes: int = 10) -> dict:
    """The most layers of the family's next size that fit with auto+fsdp (see the docstring)."""
    from redco_planner.planner import model_shard_degrees
    name, seq_len = row["family"]
    full = full_layers(name)
    devices, memory = row["devices"], row["memory_gib"] * GiB
    start = time.perf_counter()
    log(f"[{row['server']}] largest: {name} ({seq_len}), layers searched, auto+fsdp")
    # 1. a line in the layer count per n_model_shards, from two small compiles
    lines = []
    for mp in model_shard_degrees(devices):
        if devices // mp > max_full_dp:
            log(f"  mp={mp}: skipped (dp > --max-full-dp)")
            continue
        pts = []
        for layers in points:
            m = measure(build(name, seq_len, **with_layers(name, layers)), devices, mp,
                        "auto+fsdp")
            pts.append((layers, m["peak"]))
        if any(p is None for _, p in pts):
            log(f"  mp={mp}: failed to compile")
            continue
        intercept, slope = line(pts)
        guess = int((memory - intercept) // slope) if slope > 0 else full
        lines.append(dict(mp=mp, slope=slope, intercept=intercept, guess=guess, points=pts))
        log(f"  mp={mp:<2} line: {gib(intercept)} GiB + {slope / 2**20:.1f} MiB/layer -> "
            f"guess {guess} layers")
    if not lines:
        return dict(model=name, error="no layout compiled")
    pick = max(lines, key=lambda ln: (ln["guess"], -ln["points"][-1][1]))
    mp = pick["mp"]
    # 2. bisection of real compiles at the picked layout, starting at the line's guess
    probes, lo, hi = {}, 0, full + 1  # lo fits (0: nothing yet), hi does not
    nxt = max(1, min(pick["guess"], full))
    while hi - lo > 1 and len(probes) < max_probes:
        model = build(name, seq_len, **with_layers(name, nxt))
        m = measure(model, devices, mp, "auto+fsdp")
        m["params"] = n_params(model)
        m["line_peak"] = pick["intercept"] + pick["slope"] * nxt
        probes[nxt] = m
        fits = m["peak"] is not None and m["peak"] <= memory
        log(f"  {nxt} layers ({m['params'] / 1e9:.2f}B): " + describe(m, memory) +
            f"; the line said {gib(m['line_peak'])} GiB")
        lo, hi = (nxt, hi) if fits else (lo, nxt)
        if hi - lo <= 1:
            break
        if fits and nxt + 1 < hi and nxt + 1 not in probes and len(probes) == 1:
            nxt += 1  # the line's guess fits: is it the last that does?
        elif not fits and nxt - 1 > lo and nxt - 1 not in probes and len(probes) == 1:
            nxt -= 1
        else:
            nxt = (lo + hi) // 2
    return dict(model=name, seq_len=seq_len, mp=mp, dp=devices // mp, full_layers=full,
                layers=lo, params=probes[lo]["params"] if lo in probes else 0,
                peak=probes[lo]["peak"] if lo in probes else None,
                next_peak=probes[hi]["peak"] if hi in probes else None,
                full_fits=lo == full, lines=lines,
                probes={str(k): v for k, v in sorted(probes.items())},
                converged=hi - lo <= 1, wall_s=round(time.perf_counter() - start, 1))


def worker(args) -> None:
    import jax
    row = dict(ROWS[args.row])
    assert jax.device_count() >= row["devices"], jax.devices()
    start = time.perf_counter()
    models = [run_model(name, seq, row, args.quick, args.max_full_dp)
              for name, seq in row["models"] if not args.models or name in args.models]
    search = not (args.quick or args.no_largest) and (
        not args.models or row["family"][0] in args.models)
    big = largest(row, args.max_full_dp) if search else None
    result = dict(row=args.row, **row, results=models, largest=big,
                  wall_s=round(time.perf_counter() - start, 1), jax=jax.__version__)
    Path(args.out).write_text(json.dumps(result, indent=1))


# ---- the report --------------------------------------------------------------------------------
def table(rows: list[dict]) -> str:
    lines = ["| server | devices x memory | model (length) | params (nominal) | "
             "`auto`, mp = devices: peak/device | fits | best `auto+fsdp`: mp x dp, "
             "peak/device | fits | every `auto+fsdp` layout, mp: GiB |",
             "|---|---|---|---:|---:|:-:|---:|:-:|---|"]
    for row in rows:
        memory = row["memory_gib"] * GiB
        for r in row["results"]:
            best = r["best_fsdp"]
            note = f", {r['note']}" if r["note"] else ""
            lines.append(
                f"| {row['server']} | {row['devices']} x {row['memory_gib']} GiB | "
                f"{r['model']} ({r['seq_len']}{note}) | {r['params'] / 1e9:.3f}B "
                f"({r['nominal'] / 1e9:g}B) | {gib(r['auto']['peak'])} GiB | "
                f"{'yes' if r['fits_auto'] else 'no'} | "
                + (f"{best['mp']} x {best['dp']}: {gib(best['peak'])} GiB | "
                   f"{'yes' if best['peak'] <= memory else 'no'} |" if best else "failed | no |")
                + " " + ", ".join(layout_cell(m) for m in r["fsdp"]) + " |")
    return "\n".join(lines)


def layout_cell(m: dict) -> str:
    """``mp: GiB``; extrapolated ones as ``mp: ~GiB*``, failed ones as ``mp: failed``."""
    if m.get("extrapolated"):
        return f"{m['mp']}: ~{m['extrapolated_peak'] / GiB:.0f}*"
    return f"{m['mp']}: " + ("failed" if m["peak"] is None else f"{m['peak'] / GiB:.1f}")


def largest_table(rows: list[dict]) -> str:
    lines = ["| server | family config (length) | layout | most layers that fit "
             "| params | peak at L / L+1 (GiB) | the line's guess |",
             "|---|---|---|---:|---:|---:|---:|"]
    for row in rows:
        big = row.get("largest")
        if not big or "error" in big:
            continue
        pick = next(ln for ln in big["lines"] if ln["mp"] == big["mp"])
        layers = (f"{big['layers']} of {big['full_layers']}" +
                  (" (all)" if big["full_fits"] else ""))
        lines.append(f"| {row['server']} | {big['model']} ({big['seq_len']}) | mp={big['mp']} "
                     f"dp={big['dp']} | {layers} | {big['params'] / 1e9:.2f}B | "
                     f"{gib(big['peak'])} / {gib(big['next_peak'])} | {pick['guess']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(ROWS), help=f"of {','.join(ROWS)}")
    parser.add_argument("--models", default="", help="only these config names, e.g. opt-13b")
    parser.add_argument("--quick", action="store_true",
                        help="auto+fsdp only at mp=1 (no mp scan), no largest-model search")
    parser.add_argument("--no-largest", action="store_true", help="skip the largest-model search")
    parser.add_argument("--max-full-dp", type=int, default=8,
                        help="auto+fsdp layouts with more data-parallel devices than this are "
                        "not compiled at full depth (on a CPU, XLA's compile time and memory "
                        "grow with dp x layers: OPT-66B at dp=64 took > 9 min and > 17 GB); "
                        "their peak is extrapolated from 2, 4 and 6 layers and labelled so")
    parser.add_argument("--json", help="write every measurement here")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # worker mode: one row
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.models = [m for m in args.models.split(",") if m]
    if args.row:
        return worker(args)
    unknown = [m for m in args.models if m not in CONFIGS]
    if unknown:
        parser.error(f"unknown models {unknown}: known are {list(CONFIGS)}")
    rows = [r for r in args.rows.split(",") if r]
    if any(r not in ROWS for r in rows):
        parser.error(f"--rows takes some of {list(ROWS)}")
    start, results = time.perf_counter(), []
    for key in rows:
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
                 if "xla_force_host_platform_device_count" not in f]
        env = {**os.environ, "XLA_FLAGS": " ".join(
            flags + [f"--xla_force_host_platform_device_count={ROWS[key]['devices']}"])}
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "row.json"
            cmd = [sys.executable, __file__, "--row", key, "--out", str(out),
                   "--models", ",".join(args.models)]
            cmd += ["--quick"] * args.quick + ["--no-largest"] * args.no_largest
            cmd += ["--max-full-dp", str(args.max_full_dp)]
            subprocess.run(cmd, env=env, check=True)
            results.append(json.loads(out.read_text()))
        log(f"row {key} done in {results[-1]['wall_s']:.0f}s")
        if args.json:  # after every row, so a long run keeps what it measured
            Path(args.json).write_text(json.dumps(dict(rows=results), indent=1))
    total = time.perf_counter() - start
    print(table(results))
    print()
    if any(r.get("largest") for r in results):
        print(largest_table(results))
        print()
    print(f"{len(rows)} rows in {total / 60:.1f} min ("
          + ", ".join(f"{r['row']} {r['wall_s'] / 60:.1f}" for r in results) + ")")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(rows=results, total_s=round(total, 1)),
                                              indent=1))


if __name__ == "__main__":
    from provenance import print_provenance
    print_provenance()
    main()
