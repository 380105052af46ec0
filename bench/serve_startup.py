"""``redco serve``'s start-up on a deep tiny model, its layers scanned with the key/value cache
(``--scan_layers``, ``redco_zoo_models.layer_scan``) against unrolled: the seconds of the
warm-up (every prefill and decode shape compiled before serving) and of the whole start (wall,
and the server's CPU seconds), and the warm output rate at ``--concurrent`` requests at once
through HTTP (the cost of the scan's copy of the cache in and out of its stack each step),
side by side.

The model: the tiny LLaMA 3.1 family's width (32, 4 heads / 2 KV heads) at ``--layers`` layers
(default 22, the 1.1B preset's depth), the word tokenizer's vocabulary, random weights. Each
server is its own process, with XLA's default flags and no persistent compile cache (every
shape compiles); scanned and unrolled alternate over ``--rounds`` so that a drift in the box's
load falls on both. Greedy requests of ``--new`` tokens past the end token (``ignore_eos``).

    python bench/serve_startup.py [--layers 22 --max_seqs 64 --max_len 256 --rounds 1]
"""
from __future__ import annotations

import argparse
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from provenance import print_provenance  # noqa: E402
from serve_http import WORDS, burst, cpu_seconds  # noqa: E402

NO_CACHE = ("JAX_COMPILATION_CACHE_DIR", "REDCO_COMPILE_CACHE", "XLA_FLAGS")


def start(model_dir: str, scan: bool, args) -> tuple[subprocess.Popen, str, dict]:
    """A server on ``model_dir``: ``(process, url, times)``, ``times`` the wall seconds from
    launch to each start-up line (loaded: its sequences line; warmed: its compiled-shapes line;
    serving) and the server's CPU seconds by then (``cpu_loaded``, ...: a loaded box stretches
    the wall, less the CPU)."""
    env = {k: v for k, v in os.environ.items() if k not in NO_CACHE}
    process = subprocess.Popen(
        [sys.executable, "-m", "redco.cli", "serve", "--model", model_dir, "--port", "0",
         "--max_seqs", str(args.max_seqs), "--max_len", str(args.max_len)]
        + (["--scan_layers"] if scan else []),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in process.stdout] + [lines.put(None)],
                     daemon=True).start()
    launched, deadline, times = time.monotonic(), time.monotonic() + args.limit_s, {}
    while (line := lines.get(timeout=max(0.0, deadline - time.monotonic()))) is not None:
        now = time.monotonic() - launched
        print(f"  [{'scanned' if scan else 'unrolled'}, {now:6.1f} s] {line.rstrip()}",
              flush=True)
        for key, says in (("loaded", " at once"), ("warmed", "step shapes"),
                          ("serving", " on http")):
            if says in line:
                times[key], times[f"cpu_{key}"] = now, cpu_seconds(process.pid)
        if "serving" in times:
            return process, line.split(" on ")[1].strip(), times
    raise RuntimeError("the server exited before serving")


def measure(model_dir: str, scan: bool, args) -> dict:
    """One server's start-up seconds and its warm output tok/s at ``--concurrent`` at once."""
    import openai
    process, url, times = start(model_dir, scan, args)
    try:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
        burst(client, args.concurrent, args.new)  # (the shapes are warm: a first pass anyway)
        rates = []
        for _ in range(3):
            seconds, tokens = burst(client, args.concurrent, args.new)
            rates.append(tokens / seconds)
    finally:
        process.terminate()
        process.wait(timeout=120)
    return {"warm_up_s": times["warmed"] - times["loaded"], "start_s": times["serving"],
            "warm_up_cpu_s": times["cpu_warmed"] - times["cpu_loaded"],
            "start_cpu_s": times["cpu_serving"], "tok_s": statistics.median(rates)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--max_seqs", type=int, default=64)
    parser.add_argument("--max_len", type=int, default=256)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--concurrent", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--limit_s", type=float, default=3600, help="a server's start limit")
    args = parser.parse_args()
    print_provenance()
    from redco_zoo_models.toy import save_tiny_chat_model
    runs: dict = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny_chat_model(os.path.join(tmp, "tiny"), WORDS, family="llama-3.1",
                                         num_hidden_layers=args.layers)
        for _ in range(args.rounds):
            for scan in (True, False):
                runs[scan].append(measure(model_dir, scan, args))
    print(f"tiny LLaMA 3.1 width (32) at {args.layers} layers, --max_seqs {args.max_seqs} "
          f"--max_len {args.max_len}, XLA's default flags, no compile cache; medians of "
          f"{args.rounds} round(s); tok/s: {args.concurrent} requests of {args.new} tokens at once")
    print(f"{'layers':>10} {'warm-up s':>10} {'CPU s':>7} {'start s':>8} {'CPU s':>7} "
          f"{'tok/s':>7}")
    for scan in (True, False):
        row = {k: statistics.median(r[k] for r in runs[scan]) for k in runs[scan][0]}
        print(f"{'scanned' if scan else 'unrolled':>10} {row['warm_up_s']:>10.1f} "
              f"{row['warm_up_cpu_s']:>7.1f} {row['start_s']:>8.1f} {row['start_cpu_s']:>7.1f} "
              f"{row['tok_s']:>7.0f}", flush=True)


if __name__ == "__main__":
    main()
