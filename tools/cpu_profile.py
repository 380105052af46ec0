"""Where the suite's time goes, in CPU seconds: a pytest plugin that appends one JSON line per
test (its tox environment, node id, wall seconds, and CPU seconds of the test process plus the
subprocesses it waited for) to ``$CPU_PROFILE_OUT``, and a summary of such files.

CPU seconds, unlike wall seconds, stay put on a box shared with other work, so two runs compare.
Every environment of a run at once (tox passes PYTEST_ADDOPTS; the plugin must be importable in
each environment, e.g. copied into its site-packages)::

    PYTHONPATH=tools CPU_PROFILE_OUT=/tmp/cpu.jsonl python -m pytest -p cpu_profile tests/zoo
    python tools/cpu_profile.py /tmp/cpu.jsonl --top 30

A test whose own subprocess runs pytest with the plugin (the templates' generated projects) is
counted twice: once itself, once as the subprocess's tests. ``--processes`` summarises
``tests/every_process/process_profile.py``'s lines instead (one per Python process, with
jax's compile phases)."""
from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import time


def _cpu_s() -> float:
    own, children = (resource.getrusage(who) for who in
                     (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _hookwrapper(function):
    import pytest
    return pytest.hookimpl(hookwrapper=True)(function)


if os.environ.get("CPU_PROFILE_OUT"):
    @_hookwrapper
    def pytest_runtest_protocol(item, nextitem):
        cpu, wall = _cpu_s(), time.time()
        yield
        row = {"env": os.environ.get("TOX_ENV_NAME", ""), "id": item.nodeid,
               "wall": time.time() - wall, "cpu": _cpu_s() - cpu}
        with open(os.environ["CPU_PROFILE_OUT"], "a") as f:
            f.write(json.dumps(row) + "\n")


def summary(rows: list[dict], top: int) -> str:
    """CPU and wall seconds per environment, then the ``top`` costliest tests."""
    per_env = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for row in rows:
        total = per_env[row["env"]]
        total[0] += 1
        total[1] += row["cpu"]
        total[2] += row["wall"]
    lines = [f"{'environment':16s} {'tests':>5s} {'cpu s':>8s} {'wall s':>8s}"]
    for env, (n, cpu, wall) in sorted(per_env.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"{env:16s} {n:5d} {cpu:8.0f} {wall:8.0f}")
    lines.append(f"{'all':16s} {len(rows):5d} {sum(r['cpu'] for r in rows):8.0f}")
    for row in sorted(rows, key=lambda r: -r["cpu"])[:top]:
        lines.append(f"{row['cpu']:7.1f} {row['env']:14s} {row['id']}")
    return "\n".join(lines)


PHASES = ("backend_compile_duration", "jaxpr_trace_duration", "jaxpr_to_mlir_module_duration")


def kind(argv: list[str]) -> str:
    if any("pytest" in a for a in argv[:2]):
        return "pytest"
    if argv[:1] == ["-m"] and len(argv) > 1:
        return "-m " + argv[1]
    return argv[0].rsplit("/", 1)[-1] if argv else "?"


def process_summary(rows: list[dict], top: int) -> str:
    """``tests/every_process/process_profile.py``'s lines per tox environment and kind of
    process (pytest, a script, ``-c``): how many, their CPU seconds and jax's compile, trace
    and lower seconds; then the ``top`` costliest compiled functions."""
    totals: dict = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0])
    functions: collections.Counter = collections.Counter()
    for row in rows:
        events = row["events"]
        values = [1, row["cpu"], *(events.get(p, [0.0])[0] for p in PHASES)]
        for key in ((row["env"], kind(row["argv"])), ("all", "")):
            totals[key] = [a + b for a, b in zip(totals[key], values)]
        functions.update(row["functions"])
    lines = [f"{'environment':16s} {'process':24s} {'n':>4s} {'cpu s':>8s} {'compile':>8s} "
             f"{'trace':>7s} {'lower':>7s}"]
    for (env, what), (n, cpu, backend, trace, lower) in sorted(totals.items(),
                                                              key=lambda kv: -kv[1][1]):
        lines.append(f"{env:16s} {what[:24]:24s} {n:4d} {cpu:8.0f} {backend:8.0f} {trace:7.0f} "
                     f"{lower:7.0f}")
    lines.append("costliest compiled functions (tracing, lowering and compiling, seconds):")
    lines += [f"{seconds:8.1f}  {name or '?'}" for name, seconds in functions.most_common(top)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="JSON-lines files the plugin wrote")
    parser.add_argument("--top", type=int, default=25, help="costliest tests to list")
    parser.add_argument("--processes", action="store_true", help="the files are "
                        "tests/every_process/process_profile.py's, one line per process: "
                        "summarise those")
    args = parser.parse_args()
    rows = [json.loads(line) for path in args.files for line in open(path) if line.strip()]
    print((process_summary if args.processes else summary)(rows, args.top))


if __name__ == "__main__":
    main()
