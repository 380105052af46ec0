"""Host memory of training on a token file as the file grows: 1, 4 and 16 GB side by side, rows
of 128 and 2,048 tokens, on the first run (which scans and packs) and on a rerun (which reads
the index and the plan back).

Each file holds random tokens (vocabulary 512) in documents of 10-3,000 tokens, each ending in
EOS, written once into ``--dir``. For each file and row width, a fresh process opens it
(``TokenFile``), packs it (``PackedRows``), holds out every 20th row as ``redco zoo run lm``
does (``hold_out``) and trains a tiny LLaMA (hidden 64, 2 layers, ``remat="full"``) for
``--steps`` updates of ``--tokens`` tokens (8 rows of 128, 1 of 2,048) through ``Trainer.fit``,
which shuffles the whole training share (above 2^20 rows by ``redco/permutation.py``), on one
CPU device (whose buffers are host memory too). "First run" deletes the file's index and plan
before; "rerun" is the same process again. Printed per run: documents, rows, seconds to open and
plan, the padding share, and the process's peak resident memory (``VmHWM``); then each run's
peak on the largest file over its peak on the smallest. Held per row, 8 bytes would be 0.5 GB at
16 GB and 128.

    python bench/corpus_memory.py [--dir /tmp/redco-corpus] [--sizes_gb 1,4,16] [--rows 128,2048]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

EOS, VOCAB = 0, 512


def make_file(path: str, gigabytes: float, seed: int = 0) -> None:
    """Random documents of 10-3,000 tokens (uint16), each ending in EOS, ``gigabytes`` in all."""
    rng, remaining = np.random.default_rng(seed), int(gigabytes * 2**30 / 2)
    with open(path + ".tmp", "wb") as f:
        while remaining > 0:
            lengths = rng.integers(10, 3001, 20_000)
            block = rng.integers(1, VOCAB, int(lengths.sum()), dtype=np.uint16)
            block[np.cumsum(lengths) - 1] = EOS
            block[:remaining].tofile(f)
            remaining -= len(block)
    os.replace(path + ".tmp", path)


def worker(path: str, row: int, steps: int, batch: int) -> dict:
    import optax
    from flax import nnx

    from redco import Deployer, Trainer
    from redco_zoo_lm.corpus import TokenFile
    from redco_zoo_lm.packing import PackedRows, hold_out
    from redco_zoo_lm.pipeline import collate_fn, loss_fn
    from redco_zoo_models import LlamaConfig, LlamaForCausalLM, split_model
    start = time.perf_counter()
    corpus = TokenFile(path, EOS, vocab_size=VOCAB)
    rows = PackedRows(corpus, row - 1)
    planned = time.perf_counter()
    train, _ = hold_out(rows)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    apply_fn, params = split_model(LlamaForCausalLM(config, rngs=nnx.Rngs(0)))
    trainer = Trainer(Deployer(jax_seed=0, workdir=tempfile.mkdtemp(), verbose=False),
                      collate_fn, apply_fn, loss_fn, params, optax.adamw(1e-3), remat="full")
    trainer.fit(train, per_device_batch_size=batch, n_epochs=1, max_steps=steps)
    return {"documents": len(corpus), "rows": len(rows), "open_s": planned - start,
            "padding": rows.padding_share, "train_s": time.perf_counter() - planned,
            "peak_rss_mb": rss_mb("VmHWM")}


def rss_mb(field: str) -> float:
    """``VmRSS`` (now) or ``VmHWM`` (the peak) of this process, in MB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024


def run(path: str, row: int, args, first: bool) -> dict:
    """One fresh process on ``path`` (first run: its index and plans deleted before)."""
    if first:
        for kept in glob.glob(path + ".index") + glob.glob(path + ".rows*"):
            shutil.rmtree(kept)
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", path, "--row",
                          str(row), "--steps", str(args.steps),
                          "--batch", str(max(args.tokens // row, 1))],
                         capture_output=True, text=True, env={**os.environ, "XLA_FLAGS": ""})
    if out.returncode:
        sys.exit(f"{path}: failed\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp/redco-corpus")
    parser.add_argument("--sizes_gb", default="1,4,16")
    parser.add_argument("--rows", default="128,2048")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--tokens", type=int, default=1024, help="per update")
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--row", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.row, args.steps, args.batch)), flush=True)
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from provenance import print_provenance
    print_provenance()
    os.makedirs(args.dir, exist_ok=True)
    sizes = [float(s) for s in args.sizes_gb.split(",")]
    widths = [int(r) for r in args.rows.split(",")]
    print("| file | rows of | documents | rows | padding | first run: open s | peak RSS | "
          "rerun: open s | peak RSS |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    peaks = {}
    for size in sizes:
        path = os.path.join(args.dir, f"random_{size:g}gb.bin")
        if not os.path.exists(path):
            make_file(path, size)
        for row in widths:
            first, again = run(path, row, args, True), run(path, row, args, False)
            peaks[size, row] = first["peak_rss_mb"], again["peak_rss_mb"]
            print(f"| {size:g} GB | {row:,} | {first['documents']:,} | {first['rows']:,} | "
                  f"{first['padding']:.2%} | {first['open_s']:.1f} | "
                  f"{first['peak_rss_mb']:,.0f} MB | {again['open_s']:.1f} | "
                  f"{again['peak_rss_mb']:,.0f} MB |", flush=True)
    small, large = min(sizes), max(sizes)
    for row in widths:
        ratios = [peaks[large, row][i] / peaks[small, row][i] for i in (0, 1)]
        print(f"\nrows of {row:,}: peak RSS {large:g} GB / {small:g} GB: first run "
              f"{ratios[0]:.3f}, rerun {ratios[1]:.3f}")


if __name__ == "__main__":
    main()
