"""Host memory of training on a token file as the file grows: a 1 GB and a 4 GB file side by side.

Each file holds random tokens (vocabulary 512) in documents of 10-3,000 tokens, each ending in
EOS, written once into ``--dir``. For each, a fresh process opens it (``TokenFile``: one scan),
packs it into rows of 2,048 tokens (``PackedRows``, best-fit), and trains a tiny LLaMA (hidden 64,
2 layers, ``remat="full"``) for ``--steps`` updates of ``--batch`` rows drawn at random from the
whole file, through ``Trainer.fit``, on one CPU device (whose buffers are host memory too).
Printed per file: its documents and tokens, the seconds to scan and plan, the padding share, the
process's resident memory once the corpus is open and planned and the Trainer made (``VmRSS``),
and its peak (``VmHWM``); then the 4 GB / 1 GB ratio of the peaks. A loader that held the corpus
in memory would show a peak above each file's size and a ratio near 4.

    python bench/corpus_memory.py [--dir /tmp/redco-corpus] [--steps 200]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

EOS, VOCAB, ROW = 0, 512, 2048


def make_file(path: str, gigabytes: float, seed: int = 0) -> None:
    """Random documents of 10-3,000 tokens (uint16), each ending in EOS, ``gigabytes`` in all."""
    rng, remaining = np.random.default_rng(seed), int(gigabytes * 2**30 / 2)
    with open(path + ".tmp", "wb") as f:
        while remaining > 0:
            lengths = rng.integers(10, 3001, 20_000)
            block = rng.integers(1, VOCAB, int(lengths.sum())).astype(np.uint16)
            block[np.cumsum(lengths) - 1] = EOS
            block[:remaining].tofile(f)
            remaining -= len(block)
    os.replace(path + ".tmp", path)


def worker(path: str, steps: int, batch: int) -> dict:
    import optax
    from flax import nnx

    from redco import Deployer, Trainer
    from redco_zoo_lm.corpus import TokenFile
    from redco_zoo_lm.packing import PackedRows, RowsView
    from redco_zoo_lm.pipeline import collate_fn, loss_fn
    from redco_zoo_models import LlamaConfig, LlamaForCausalLM, split_model
    start = time.perf_counter()
    corpus = TokenFile(path, EOS, vocab_size=VOCAB)
    scanned = time.perf_counter()
    rows = PackedRows(corpus, ROW - 1)
    planned = time.perf_counter()
    drawn = RowsView(rows, np.random.default_rng(0).permutation(len(rows))[:steps * batch])
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    apply_fn, params = split_model(LlamaForCausalLM(config, rngs=nnx.Rngs(0)))
    trainer = Trainer(Deployer(jax_seed=0, workdir=tempfile.mkdtemp(), verbose=False),
                      collate_fn, apply_fn, loss_fn, params, optax.adamw(1e-3), remat="full")
    loaded_mb = rss_mb("VmRSS")
    trainer.fit(drawn, per_device_batch_size=batch, n_epochs=1)
    return {"documents": len(corpus), "tokens": corpus.n_tokens, "rows": len(rows),
            "scan_s": scanned - start, "plan_s": planned - scanned,
            "padding": rows.padding_share, "train_s": time.perf_counter() - planned,
            "rss_before_training_mb": loaded_mb, "peak_rss_mb": rss_mb("VmHWM")}


def rss_mb(field: str) -> float:
    """``VmRSS`` (now) or ``VmHWM`` (the peak) of this process, in MB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp/redco-corpus")
    parser.add_argument("--sizes_gb", default="1,4")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.steps, args.batch)), flush=True)
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from provenance import print_provenance
    print_provenance()
    os.makedirs(args.dir, exist_ok=True)
    results = {}
    for size in map(float, args.sizes_gb.split(",")):
        path = os.path.join(args.dir, f"random_{size:g}gb.bin")
        if not os.path.exists(path):
            make_file(path, size)
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", path,
                              "--steps", str(args.steps), "--batch", str(args.batch)],
                             capture_output=True, text=True, env={**os.environ, "XLA_FLAGS": ""})
        if out.returncode:
            sys.exit(f"{path}: failed\n{out.stderr[-3000:]}")
        results[size] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{size:g} GB: {json.dumps(results[size])}", flush=True)
    print(f"\n| file | documents | tokens | scan s | plan s | padding | {args.steps} updates s | "
          "RSS before training | peak RSS |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for size, r in results.items():
        print(f"| {size:g} GB | {r['documents']:,} | {r['tokens']:,} | {r['scan_s']:.1f} | "
              f"{r['plan_s']:.1f} | {r['padding']:.2%} | {r['train_s']:.1f} | "
              f"{r['rss_before_training_mb']:,.0f} MB | {r['peak_rss_mb']:,.0f} MB |")
    sizes = sorted(results)
    if len(sizes) > 1:
        print(f"\npeak RSS, {sizes[-1]:g} GB / {sizes[0]:g} GB: "
              f"{results[sizes[-1]]['peak_rss_mb'] / results[sizes[0]]['peak_rss_mb']:.3f}")


if __name__ == "__main__":
    main()
