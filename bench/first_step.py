"""Seconds from a process's start to its first completed train step, for the main job
(``python -m redco_zoo_lm.demo``, its default model on 8 simulated devices), started three ways:

* cold:   an empty compile cache and a fresh workdir;
* warm:   a fresh workdir, the compile cache the cold start filled;
* resume: the warm cache, and a workdir holding a step checkpoint (step_50) to resume from.

A start counts as done when the demo's ``metrics.jsonl`` holds a train row past the step it
started from (the row of update k is written once update k+1 is dispatched); the process is then
stopped. Each start is repeated ``--repeats`` times, alternating, and the medians are printed
with their ratio to the cold start's. ``log.txt``'s own line of each start says how long tracing
and compiling the step took and where the program came from.

    python bench/first_step.py [--repeats 3]
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


def start(workdir: str, cache: str, after_step: int = 0, until_ckpt: str | None = None
          ) -> tuple[float, str]:
    """Start the demo; stop it at its first train row past ``after_step`` (or, with
    ``until_ckpt``, once that checkpoint exists); seconds taken and log.txt's compile line."""
    env = {**os.environ, "REDCO_COMPILE_CACHE": cache}
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
        lines = re.findall(r"First train step traced and compiled in .*", f.read())
    return seconds, lines[-1] if lines else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
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
    cold = statistics.median(times["cold"])
    print("\n| start | seconds to the first step (median) | / cold |\n| --- | ---: | ---: |")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.2f} | {median / cold:.2f} |")


if __name__ == "__main__":
    main()
