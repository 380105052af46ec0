"""Compile time, step time and temp memory of the zoo decoder's training step, its layers
stored stacked and scanned (the default, ``redco_zoo_models.layer_scan``) against unrolled
(``scan_layers=False``).

The zoo LLaMA (width 256, vocab 1024, intermediate 704, 4 heads / 2 KV heads) at each depth of
``--depths``; 8 simulated CPU devices, dp 4 x mp 2, one row of ``--seq_len`` tokens (128) per
device, AdamW; remat "none" (``--remat``), which in the scanned body keeps matmuls against
weights and attention's output (``redco.remat.scanned_body``); XLA's
default flags (this script sets only the device count). Each side gets the default rules, read
off its own dataflow (``auto``; the stacked params' specs are the unrolled layers' behind an
unsplit layer axis, ``tests/zoo/test_scan_layers.py``). For each depth and each of scanned /
unrolled: the seconds of ``Trainer.compile_train_step`` (tracing, deciding the layout,
lowering, compiling), XLA's temp bytes of the compiled step, then the step time (the median over
``--repeats`` timed runs of ``--steps`` steps after a warm-up, scanned and unrolled timed in
turn so that a drift in the machine's load falls on both).

    python bench/scan_compile.py                      # depths 4 8 16 32
    python bench/scan_compile.py --depths 4 8 16 32 80
    python bench/scan_compile.py --depths 4 32 --remat full   # each layer rematerialised
    python bench/scan_compile.py --scan_remat dots_saveable   # a policy in the scanned body only
    python bench/scan_compile.py --depths 8 --seq_len 1024     # attention's memory to the fore
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
WIDTH, VOCAB = 256, 1024


def model(n_layers: int, scan: bool) -> tuple:
    """``(apply_fn, params)`` of the zoo LLaMA (the same params scanned or not)."""
    from flax import nnx

    from redco_zoo_models import LlamaConfig, LlamaForCausalLM, split_model
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=WIDTH * 11 // 4,
                         num_hidden_layers=n_layers, num_attention_heads=4,
                         num_key_value_heads=2, scan_layers=scan)
    return split_model(LlamaForCausalLM(config, nnx.Rngs(0)))


def deployer():
    from redco import Deployer
    return Deployer(jax_seed=0, n_model_shards=2, verbose=False, compile_cache_dir=False,
                    workdir=tempfile.mkdtemp(prefix="redco-scan-bench-"))


def compiled(n_layers: int, scan: bool, remat: str | None, seq_len: int) -> dict:
    """The train step compiled (``step``), its ``state``, ``batches``, ``compile_s`` and
    ``temp_mb``."""
    import numpy as np
    import optax

    from redco import Trainer
    from redco_zoo_lm import collate_fn, loss_fn
    apply_fn, params = model(n_layers, scan)
    deployer_ = deployer()
    trainer = Trainer(deployer_, collate_fn, apply_fn, loss_fn, params, optax.adamw(1e-3),
                      remat=remat)
    rng = np.random.default_rng(0)
    batch = deployer_.get_global_batch_size(1)
    examples = [{"token_ids": rng.integers(0, VOCAB, seq_len + 1)} for _ in range(4 * batch)]
    t0 = time.perf_counter()
    step = trainer.compile_train_step(examples[:batch], 1)
    seconds = time.perf_counter() - t0
    batches = [deployer_.make_batch(examples[i * batch:(i + 1) * batch], collate_fn, n_micro=1)
               for i in range(4)]
    return {"step": step, "state": trainer.state, "batches": batches, "compile_s": seconds,
            "temp_mb": step.memory_analysis().temp_size_in_bytes / 1e6}


def timed(run: dict, steps: int) -> float:
    """Seconds per step of ``steps`` steps of ``run``'s compiled step, its state carried on."""
    import jax
    t0 = time.perf_counter()
    for i in range(steps):
        run["state"], metrics = run["step"](run["state"], run["batches"][i % len(run["batches"])])
    jax.block_until_ready((run["state"], metrics))
    return (time.perf_counter() - t0) / steps


def measure(n_layers: int, args: argparse.Namespace) -> dict:
    runs = {scan: compiled(n_layers, scan, args.scan_remat if scan and args.scan_remat else
                           args.remat, args.seq_len) for scan in (True, False)}
    for run in runs.values():
        timed(run, 1)  # warm-up
    times = {True: [], False: []}
    for _ in range(args.repeats):
        for scan, run in runs.items():
            times[scan].append(timed(run, args.steps))
    return {"layers": n_layers, **{f"compile_{k}": runs[s]["compile_s"] for k, s in
                                   (("scan", True), ("unrolled", False))},
            **{f"step_{k}": statistics.median(times[s]) for k, s in
               (("scan", True), ("unrolled", False))},
            **{f"temp_{k}": runs[s]["temp_mb"] for k, s in (("scan", True), ("unrolled", False))}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--seq_len", type=int, default=128, help="tokens per row (one a device)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--remat", default=None, help="the Trainer's remat policy (default none)")
    parser.add_argument("--scan_remat", default=None,
                        help="the scanned side's policy, where it differs from --remat")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from provenance import print_provenance
    print_provenance()
    print(f"zoo LLaMA width {WIDTH}, vocab {VOCAB}, {args.seq_len} tokens per device, 8 CPU devices "
          f"dp4 x mp2, AdamW, remat {args.remat or 'none'} (scanned: "
          f"{args.scan_remat or args.remat or 'none'}); step time: median of {args.repeats} "
          f"x {args.steps} steps")
    print(f"{'layers':>6} | {'compile scan s':>14} | {'compile unrolled s':>18} | "
          f"{'step scan ms':>12} | {'step unrolled ms':>16} | {'scan / unrolled step':>20} | "
          f"{'temp scan MB':>12} | {'temp unrolled MB':>16}")
    first = None
    for n_layers in args.depths:
        row = measure(n_layers, args)
        first = first or row
        print(f"{n_layers:>6} | {row['compile_scan']:>14.1f} | {row['compile_unrolled']:>18.1f} | "
              f"{row['step_scan'] * 1e3:>12.1f} | {row['step_unrolled'] * 1e3:>16.1f} | "
              f"{row['step_scan'] / row['step_unrolled']:>20.3f} | {row['temp_scan']:>12.1f} | "
              f"{row['temp_unrolled']:>16.1f}", flush=True)
    print(f"scanned compile at {args.depths[-1]} layers / at {args.depths[0]}: "
          f"{row['compile_scan'] / first['compile_scan']:.2f}x (unrolled: "
          f"{row['compile_unrolled'] / first['compile_unrolled']:.2f}x)")


if __name__ == "__main__":
    main()
