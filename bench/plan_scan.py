"""``redco plan`` on a published decoder, its layers unrolled (the default) against stored stacked
and scanned (``--scan_layers``): the planner's wall time, its pick and the peaks it measured.

Unrolled, every candidate layout compiles the whole model, one copy of a layer per layer (issue
59: llama-3.1-70b on 16 x 141 GB took ~20 minutes); scanned, it compiles one layer's body per
run of like layers, at full depth (BENCHMARKS.md section 33: the compile stops growing with
depth). Each case runs ``redco plan`` in its own process, unrolled then scanned, one after the
other on the same machine, with XLA's default flags and no compile cache (``XLA_FLAGS`` and the
cache variables dropped from the processes' environment). Wall seconds are the process's,
start to exit (building the model, tracing its dataflow, every compile). The peaks differ: a
scanned step's temporaries are not an unrolled one's (section 33), so each side's pick is its
own.

Run:  python bench/plan_scan.py [--cases llama-3.1-8b:8:80GB llama-3.1-70b:8:80GB ...]
          [--extra "--remat"]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from provenance import print_provenance

CASES = ("llama-3.1-8b:8:80GB", "llama-3.1-70b:8:80GB")
UNSET = ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR", "REDCO_COMPILE_CACHE")


def run_plan(model: str, devices: str, memory: str, scan: bool, extra: list[str]) -> dict:
    """One ``redco plan`` process: its wall seconds, pick line and the layouts it tried."""
    cmd = [sys.executable, "-c", "from redco.cli import main; main()", "plan", "--model", model,
           "--devices", devices, "--device_memory", memory, *extra, *(["--scan_layers"] if scan else [])]
    start = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    lines = proc.stdout.splitlines()
    picks = [line for line in lines if line.startswith("pick:")]
    tried = [" ".join(line.split()) for line in lines if line.lstrip().startswith("mp=")]
    compiles = sum("compiled in" in line for line in lines)
    if proc.returncode and not picks:
        picks = [(proc.stderr.strip().splitlines() or ["(no output)"])[-1][:300]]
    return {"wall": wall, "pick": picks[0] if picks else "?", "tried": tried,
            "compiles": compiles, "rc": proc.returncode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(CASES),
                        help="model:devices:device_memory")
    parser.add_argument("--extra", default="", help="more redco plan flags, e.g. --remat")
    args = parser.parse_args()
    print_provenance()
    for case in args.cases:
        model, devices, memory = case.split(":")
        results = {scan: run_plan(model, devices, memory, scan, args.extra.split())
                   for scan in (False, True)}
        print(f"== redco plan --model {model} --devices {devices} --device_memory {memory} "
              f"{args.extra}".rstrip())
        for scan, r in results.items():
            side = "scanned " if scan else "unrolled"
            print(f"{side}: {r['wall']:7.1f} s wall, {r['compiles']} compiles, rc {r['rc']}; "
                  f"{r['pick']}")
            for line in r["tried"]:
                print(f"    {line}")
        ratio = results[False]["wall"] / results[True]["wall"]
        print(f"unrolled / scanned wall: {ratio:.2f}x\n", flush=True)


if __name__ == "__main__":
    main()
