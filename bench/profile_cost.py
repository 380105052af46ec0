"""What a profile costs: the main job (``python -m redco_zoo_lm.demo --n_epochs 1``) run unchanged
without a profile and with ``REDCO_PROFILE_STEPS`` windows of several lengths, side by side.

Each run is a fresh process in a fresh workdir (the compile cache shared, filled by a first run
that is not counted). Printed per run: the window, its wall time, the process's peak resident
memory (``wait4``'s ``ru_maxrss``), the trace files' bytes, and the first two as ratios to the
run without a profile.

    python bench/profile_cost.py [--windows 20:24,20:59] [--repeats 1]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from provenance import print_provenance  # noqa: E402

DEMO = [sys.executable, "-m", "redco_zoo_lm.demo", "--n_epochs", "1"]


def run(window: str | None, cache: str) -> dict:
    """One run of the demo; its wall seconds, peak RSS (MiB) and trace bytes."""
    workdir = tempfile.mkdtemp(prefix="profile-cost-")
    env = dict(os.environ, REDCO_COMPILE_CACHE=cache)
    env.pop("REDCO_PROFILE_STEPS", None)
    if window:
        env["REDCO_PROFILE_STEPS"] = window
    start = time.perf_counter()
    proc = subprocess.Popen(DEMO + ["--workdir", workdir], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"the demo failed (status {status}): {proc.stderr.read()[-3000:]}")
    trace = sum(os.path.getsize(os.path.join(d, f))
                for d, _, files in os.walk(os.path.join(workdir, "profile")) for f in files)
    return {"window": window or "none", "seconds": seconds, "rss_mib": usage.ru_maxrss / 1024,
            "trace_bytes": trace}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", default="20:24,20:59",
                        help="REDCO_PROFILE_STEPS values, comma-separated")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    print_provenance()
    cache = tempfile.mkdtemp(prefix="profile-cost-cache-")
    run(None, cache)  # fills the compile cache
    results = [run(window, cache) for _ in range(args.repeats)
               for window in [None, *args.windows.split(",")]]
    base = [r for r in results if r["window"] == "none"]
    seconds = sorted(r["seconds"] for r in base)[len(base) // 2]
    rss = sorted(r["rss_mib"] for r in base)[len(base) // 2]
    print("| REDCO_PROFILE_STEPS | wall, s | / none | peak RSS, MiB | / none | trace, MB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        print(f"| {r['window']} | {r['seconds']:.1f} | {r['seconds'] / seconds:.2f} | "
              f"{r['rss_mib']:.0f} | {r['rss_mib'] / rss:.2f} | {r['trace_bytes'] / 1e6:.1f} |")


if __name__ == "__main__":
    main()
