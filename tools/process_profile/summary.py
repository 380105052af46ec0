"""Summary of ``sitecustomize.py``'s lines: per tox environment and kind of process (pytest,
a script, ``-c``), how many, their CPU seconds, and the seconds jax spent compiling (XLA's
backend), tracing and lowering; then the processes' costliest compiled functions."""
from __future__ import annotations

import argparse
import collections
import json

PHASES = ("backend_compile_duration", "jaxpr_trace_duration", "jaxpr_to_mlir_module_duration")


def kind(argv: list[str]) -> str:
    if any("pytest" in a for a in argv[:2]):
        return "pytest"
    if argv[:1] == ["-m"] and len(argv) > 1:
        return "-m " + argv[1]
    return argv[0].rsplit("/", 1)[-1] if argv else "?"


def summary(rows: list[dict], top: int) -> str:
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
    parser.add_argument("files", nargs="+", help="JSON-lines files sitecustomize.py wrote")
    parser.add_argument("--top", type=int, default=20, help="compiled functions to list")
    args = parser.parse_args()
    rows = [json.loads(line) for path in args.files for line in open(path) if line.strip()]
    print(summary(rows, args.top))


if __name__ == "__main__":
    main()
