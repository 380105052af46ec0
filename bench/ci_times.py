"""CI's wall time per tox environment, run after run: ``python bench/ci_times.py --runs 3`` clones
this checkout's HEAD into a fresh directory for each run, runs ``bash .ci/run`` there (as CI
does: ``CI=true``, nothing shared between runs but pip's and uv's download caches) and prints
each environment's seconds, each run's total and whether it passed. ``--logs A B ...`` reads
the output of earlier runs (``(time CI=true bash .ci/run) > A 2>&1``) instead of running."""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
import time

from provenance import REPO, print_provenance

# tox's summary line of an environment: "  core: OK (348.75=setup[5.03]+cmd[343.72] seconds)"
ENV_LINE = re.compile(r"^  ([\w-]+): (OK|FAIL[^(]*?) ?\(([\d.]+)=setup\[([\d.]+)\]", re.M)
REAL = re.compile(r"^real\s+(\d+)m([\d.]+)s", re.M)


def parse(log: str, wall_s: float | None = None) -> dict:
    """``{"envs": {name: (status, seconds)}, "setup_s": ..., "wall_s": ..., "passed": ...}`` of
    one run's output (``setup_s``: making the environments and installing into them)."""
    found = ENV_LINE.findall(log)
    envs = {name: (status.strip(), float(s)) for name, status, s, _ in found}
    real = REAL.search(log)
    if wall_s is None and real:
        wall_s = 60 * int(real.group(1)) + float(real.group(2))
    passed = bool(envs) and all(status == "OK" for status, _ in envs.values())
    return {"envs": envs, "setup_s": sum(float(setup) for *_, setup in found), "wall_s": wall_s,
            "passed": passed}


def run_once(logs_dir: str, i: int) -> dict:
    """Clone HEAD into a fresh directory and run ``.ci/run`` there; its parsed output."""
    with tempfile.TemporaryDirectory(prefix="redco-ci-") as clone:
        subprocess.run(["git", "clone", "-q", REPO, clone], check=True)
        start = time.monotonic()
        done = subprocess.run(["bash", ".ci/run"], cwd=clone, env={**os.environ, "CI": "true"},
                              capture_output=True, text=True, stdin=subprocess.DEVNULL)
        wall_s = time.monotonic() - start
    log = done.stdout + done.stderr + f"\nreal\t{int(wall_s // 60)}m{wall_s % 60:.3f}s\n"
    with open(os.path.join(logs_dir, f"ci-run-{i}.log"), "w") as f:
        f.write(log)  # ends as bash's `time` would: --logs reads its wall time back
    return parse(log, wall_s) | {"passed": done.returncode == 0}


def table(runs: list[dict]) -> str:
    names = list(dict.fromkeys(name for run in runs for name in run["envs"]))
    head = "| environment | " + " | ".join(f"run {i + 1}" for i in range(len(runs))) + " |"
    rows = [head, "| --- |" + " ---: |" * len(runs)]
    for name in names:
        cells = [f"{run['envs'][name][1] / 60:.1f} min" + ("" if run["envs"][name][0] == "OK"
                                                          else " FAILED")
                 if name in run["envs"] else "-" for run in runs]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    rows.append("| of the above, making and installing environments | " + " | ".join(
        f"{run['setup_s'] / 60:.1f} min" for run in runs) + " |")
    rows.append("| **`.ci/run`, wall** | " + " | ".join(
        (f"**{run['wall_s'] / 60:.1f} min**" if run["wall_s"] else "-")
        + ("" if run["passed"] else " (failed)")
        for run in runs) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--logs", nargs="*", help="tabulate these logs of earlier runs instead")
    parser.add_argument("--logs_dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    print_provenance()
    if args.logs:
        results = [parse(open(path).read()) for path in args.logs]
    else:
        results = [run_once(args.logs_dir, i) for i in range(args.runs)]
    print(table(results))
