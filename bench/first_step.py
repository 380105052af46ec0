"""Seconds from a process's start to its first completed train step, for the main job
(``python -m redco_zoo_lm.demo``, its default model on 8 simulated CPU devices, or on the GPUs
there are), started three ways:

* cold:   an empty compile cache and a fresh workdir;
* warm:   a fresh workdir, the compile cache the cold start filled;
* resume: the warm cache, and a workdir holding a step checkpoint (step_50) to resume from.

A start counts as done when the demo's ``metrics.jsonl`` holds a train row past the step it
started from (the row of update k is written once update k+1 is dispatched); the process is then
stopped. Each start is repeated ``--repeats`` times, alternating, and the medians are printed
with their ratio to the cold start's. ``log.txt``'s own line of each start says how long tracing
and compiling the step took and where the program came from.

Then a big model, ahead of time: ``--aot_preset`` (default ``llama-1b``, TinyLlama-1.1B's shape)
is too big to train on a CPU, so a fresh process builds it abstractly and compiles its AdamW train
step on 8 simulated CPU devices or the GPUs there are (``n_model_shards`` = the device count, the
planner's own ``measure``), once with an
empty compile cache and once with the cache that start filled; each prints seconds from the
process's start to a compiled step, and whether the program came from the cache. ``--aot_preset
none`` skips it.

    python bench/first_step.py [--repeats 3] [--aot_preset llama-1b]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

DEMO = [sys.executable, "-m", "redco_zoo_lm.demo", "--n_epochs", "1"]
AOT_SEQ_LEN = 2048


def aot_worker(preset: str, cache: str) -> None:
    """In a fresh process: compile ``preset``'s train step ahead of time with ``cache`` as the
    compile cache; print one JSON line (seconds since the process started, the compile's own
    seconds, cache hits)."""
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import jax
    import jax.numpy as jnp

    from redco import compile_cache
    from redco_planner.inspection import load_model
    from redco_planner.measure import measure
    compile_cache.use(cache)
    model = load_model(preset, seq_len=AOT_SEQ_LEN)
    batch = {"input_ids": jax.ShapeDtypeStruct((1, AOT_SEQ_LEN + 1), jnp.int32)}
    n = jax.device_count()  # 8 simulated CPU devices, or the accelerators there are
    layout = measure(model.params, model.loss_fn, batch, n_devices=n, n_model_shards=n)
    hits, _ = compile_cache.counts()
    print(json.dumps({"seconds": time.time() - float(os.environ["REDCO_BENCH_T0"]),
                      "devices": f"{n} x {jax.devices()[0].device_kind}",
                      "compile_s": layout.compile_s, "from_cache": hits > 0}), flush=True)


def aot_start(preset: str, cache: str) -> dict:
    env = {**os.environ, "REDCO_BENCH_T0": repr(time.time())}
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", preset, cache],
                         env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def last_train_step(workdir: str) -> int:
    try:
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip().endswith("}")]
    except FileNotFoundError:
        return 0
    return max((row["step"] for row in rows if "train/loss" in row), default=0)


def forget_rows_after(workdir: str, step: int) -> None:
    path = os.path.join(workdir, "metrics.jsonl")
    with open(path) as f:
        kept = [line for line in f if line.strip().endswith("}") and json.loads(line)["step"] <= step]
    with open(path, "w") as f:
        f.writelines(kept)


MILESTONES = {"devices": "devices: ", "checked": "Sanity check passed",
              "compiled": "First train step traced and compiled"}


def milestones(log: str, began: float) -> str:
    """Seconds from the start to the first log.txt line of each of ``MILESTONES``: the Deployer
    up (imports and the backend's start before it), the evaluation's sanity check, the train
    step compiled or loaded."""
    seen = []
    for name, text in MILESTONES.items():
        match = re.search(r"^(\S+ \S+) INFO " + re.escape(text), log, re.MULTILINE)
        if match:
            stamp = time.mktime(time.strptime(match.group(1)[:19], "%Y-%m-%d %H:%M:%S"))
            seen.append(f"{name} {stamp + int(match.group(1)[20:]) / 1000 - began:5.2f}")
    return ", ".join(seen)


def start(workdir: str, cache: str, after_step: int = 0, until_ckpt: str | None = None
          ) -> tuple[float, str]:
    """Start the demo; stop it at its first train row past ``after_step`` (or, with
    ``until_ckpt``, once that checkpoint exists); seconds taken, and log.txt's milestones and
    compile line."""
    env = {**os.environ, "REDCO_COMPILE_CACHE": cache}
    began_wall = time.time()
    began = time.perf_counter()
    proc = subprocess.Popen([*DEMO, "--workdir", workdir], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        while (not os.path.isdir(os.path.join(workdir, "ckpts", until_ckpt)) if until_ckpt
               else last_train_step(workdir) <= after_step):
            assert proc.poll() is None, f"the demo exited ({proc.returncode}) before its step"
            time.sleep(0.02)
        seconds = time.perf_counter() - began
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with open(os.path.join(workdir, "log.txt")) as f:
        log = f.read()
    last = log.rfind(f"INFO {MILESTONES['devices']}")  # this start's first line, and on
    log = log[log.rfind("\n", 0, max(last, 0)) + 1:]
    lines = re.findall(r"First train step traced and compiled in .*", log)
    return seconds, f"[{milestones(log, began_wall)}] " + (lines[-1] if lines else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--aot_preset", default="llama-1b",
                        help="a redco_zoo_models.LLAMA_PRESETS name compiled ahead of time, or none")
    parser.add_argument("--worker", nargs=2, metavar=("PRESET", "CACHE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return aot_worker(*args.worker)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from provenance import print_provenance
    print_provenance()
    times: dict[str, list[float]] = {"cold": [], "warm": [], "resume": []}
    for r in range(args.repeats):
        root = tempfile.mkdtemp(prefix="first_step_")
        cache = os.path.join(root, "cache")
        for name, workdir in (("cold", "cold"), ("warm", "warm")):
            seconds, line = start(os.path.join(root, workdir), cache)
            times[name].append(seconds)
            print(f"repeat {r + 1} {name:6s} {seconds:6.2f} s   {line}", flush=True)
        resumed = os.path.join(root, "resumed")
        start(resumed, cache, until_ckpt="step_50")  # a run killed once step_50 is saved
        forget_rows_after(resumed, 50)  # what the resumed run does first: its rows are new
        seconds, line = start(resumed, cache, after_step=50)
        times["resume"].append(seconds)
        print(f"repeat {r + 1} resume {seconds:6.2f} s   {line}", flush=True)
        shutil.rmtree(root)
    print_table(times, "seconds to the first step")
    if args.aot_preset != "none":
        aot(args.aot_preset, args.repeats)


def aot(preset: str, repeats: int) -> None:
    times: dict[str, list[float]] = {"cold": [], "warm": []}
    devices = ""
    for r in range(repeats):
        cache = tempfile.mkdtemp(prefix="first_step_aot_")
        for name in times:
            row = aot_start(preset, cache)
            assert row["from_cache"] == (name == "warm"), row
            times[name].append(row["seconds"])
            devices = row["devices"]
            print(f"repeat {r + 1} {preset} {name:4s} {row['seconds']:6.2f} s to a compiled step "
                  f"(compile {row['compile_s']:.2f} s, from the cache: {row['from_cache']})",
                  flush=True)
        shutil.rmtree(cache)
    print(f"\n{preset}, seq {AOT_SEQ_LEN}, AdamW, {devices} (n_model_shards = the "
          "device count), compiled ahead of time")
    print_table(times, "seconds to a compiled train step")


def print_table(times: dict[str, list[float]], what: str) -> None:
    """Per start: the median and range of its seconds, its median over cold's, and the range of
    the paired ratios (repeat i's start over repeat i's cold start)."""
    cold = statistics.median(times["cold"])
    print(f"\n| start | {what}: median [min, max] | median / cold's | paired ratios [min, max] |"
          "\n| --- | ---: | ---: | ---: |")
    for name, values in times.items():
        ratios = [v / c for v, c in zip(values, times["cold"])]
        print(f"| {name} | {statistics.median(values):.2f} [{min(values):.2f}, "
              f"{max(values):.2f}] | {statistics.median(values) / cold:.2f} | "
              f"[{min(ratios):.2f}, {max(ratios):.2f}] |")


if __name__ == "__main__":
    main()
