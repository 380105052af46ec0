"""Redco's ``Trainer.fit`` against a minimal hand-written ``jax.jit`` loop, in one process.

Both sides train the zoo's LLaMA-style model (``redco_zoo_models.LlamaForCausalLM``) on byte
tokens of ``pydoc_data.topics``, on the same ``('dp', 'mp')`` mesh, with the same parameter and
optimizer-state shardings (taken from ``trainer.state_shardings``), the same batches in the same
order, the same optax optimizer and a donated state. Compilation is excluded (one warm-up run
of each side first); then ``--repeats`` timed runs of ``--steps`` steps each, alternating which
side goes first. Reported: the median steps/s of each side, and the median of the paired
per-repeat ratios (a pair runs back to back, so background load hits both sides alike).

Rows:
  redco Trainer.fit        fit(n_epochs=1) over exactly --steps global batches: collation,
                           Deployer.make_batch, the jitted step, the per-step metrics read-back,
                           jsonl logging, tqdm and hooks, all included.
  hand-written jit         for each step: collate_fn (same one) + jax.device_put onto
                           NamedSharding(mesh, P('dp')), then the jitted step; loss read at the
                           end only.  This is the reference for the ratio.
  hand-written, pre-placed the same loop over batches already on device: the device-bound ceiling.
  redco step, bare loop    redco's own jitted step (``trainer.steps.train``) called in the same
                           bare loop over pre-placed batches: splits a gap into "the step
                           function" (this row vs pre-placed) and "fit's host loop" (fit vs
                           this row).

Model FLOPs utilisation (``--peak_tflops``): model FLOPs per token = 6 N + 12 L T d (N = params
in matmuls, the LM head included and the embedding lookup excluded; L layers, T sequence length,
d hidden size; the second term is attention's QK^T and AV, forward and backward, counted for the
full T x T square as PaLM's appendix B does), times tokens/s, over the peak.

Run:  python bench/trainer_vs_jit.py [--steps 10 --repeats 8 --n_model_shards 2
      --per_device_batch_size 8] [--profile]
GPU:  python bench/trainer_vs_jit.py --preset llama-1b --n_model_shards 1 --compute_dtype \
      bfloat16 --peak_tflops 989 --steps 10 --repeats 3
"""
from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import cProfile  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import pstats  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pydoc_data.topics import topics  # noqa: E402

import flax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

import redco  # noqa: E402
from redco import Deployer, Trainer  # noqa: E402
from redco_zoo_models import LLAMA_PRESETS, LlamaConfig, LlamaForCausalLM, split_model  # noqa: E402


def byte_sequences(seq_len: int, n: int) -> list[dict]:
    """``n`` rows of ``seq_len + 1`` byte tokens of Python's docs (cycled if needed)."""
    data = np.frombuffer("\n".join(topics.values()).encode(), np.uint8).astype(np.int32)
    rows = data[:len(data) // (seq_len + 1) * (seq_len + 1)].reshape(-1, seq_len + 1)
    return [{"token_ids": rows[i % len(rows)]} for i in range(n)]


def collate_fn(examples: list[dict]) -> dict:  # as redco_zoo_lm.pipeline.collate_fn
    return {"input_ids": np.stack([np.asarray(e["token_ids"], np.int32) for e in examples])}


def loss_fn(rng, state, params, batch, is_training):  # as redco_zoo_lm.pipeline.loss_fn
    ids = batch["input_ids"]
    logits = state.apply_fn(params, ids[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()


def model_flops_per_token(config: LlamaConfig, seq_len: int) -> float:
    """6 N + 12 L T d: N counts every matmul weight (LM head in, embedding lookup out)."""
    d, kv = config.hidden_size, config.num_key_value_heads * config.head_dim
    per_layer = d * d * 2 + d * kv * 2 + 3 * d * config.intermediate_size
    n = config.num_hidden_layers * per_layer + d * config.vocab_size
    return 6 * n + 12 * config.num_hidden_layers * seq_len * d


def time_steps(trainer, batches: list) -> float:
    """Seconds for ``trainer``'s jitted step over ``batches`` (already placed), in a bare loop,
    until the last step's state is ready; the trainer keeps the new state."""
    t0 = time.perf_counter()
    state, metrics = trainer.state, None
    for batch in batches:
        state, metrics = trainer.steps.train(state, batch)
    float(metrics["loss"])
    jax.block_until_ready(state)
    trainer.state = state
    return time.perf_counter() - t0


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=8, help="timed repeats of each side")
    parser.add_argument("--n_model_shards", type=int, default=2)
    parser.add_argument("--per_device_batch_size", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--hidden_size", type=int, default=128)
    parser.add_argument("--n_layers", type=int, default=2)
    parser.add_argument("--n_heads", type=int, default=4)
    parser.add_argument("--n_kv_heads", type=int, default=2)
    parser.add_argument("--intermediate_size", type=int, help="default: 11/4 x hidden")
    parser.add_argument("--vocab_size", type=int, default=256)
    parser.add_argument("--preset", choices=list(LLAMA_PRESETS), help="a named model shape; "
                        "overrides the shape flags")
    parser.add_argument("--compute_dtype", default="float32", choices=["float32", "bfloat16"],
                        help="dtype the loss runs in (params and optimizer stay float32)")
    parser.add_argument("--peak_tflops", type=float,
                        help="the device's peak for --compute_dtype, to report MFU")
    parser.add_argument("--collectives", action="store_true",
                        help="count the collectives in both compiled train steps")
    parser.add_argument("--profile", action="store_true",
                        help="also cProfile one Trainer.fit repeat and time its host-side parts")
    args = parser.parse_args(argv)

    workdir = tempfile.mkdtemp(prefix="redco-bench-")
    deployer = Deployer(jax_seed=0, n_model_shards=args.n_model_shards, workdir=workdir,
                        verbose=False)
    global_batch = deployer.get_global_batch_size(args.per_device_batch_size)
    examples = byte_sequences(args.seq_len, args.steps * global_batch)

    shape = dict(hidden_size=args.hidden_size, num_hidden_layers=args.n_layers,
                 num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads,
                 intermediate_size=args.intermediate_size or args.hidden_size * 11 // 4,
                 vocab_size=args.vocab_size)
    config = LlamaConfig(**(LLAMA_PRESETS[args.preset] if args.preset else shape))
    dtype = jnp.dtype(args.compute_dtype)
    apply_fn, params = split_model(LlamaForCausalLM(config, rngs=nnx.Rngs(0)))
    host_params = jax.tree.map(np.array, params)  # each side gets its own copy (donation)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    optimizer = optax.adamw(1e-3, weight_decay=0.01)

    # ---- (a) redco -------------------------------------------------------------------------
    trainer = Trainer(deployer=deployer, collate_fn=collate_fn, apply_fn=apply_fn,
                      loss_fn=loss_fn, params=jax.tree.map(np.copy, host_params),
                      optimizer=optimizer, compute_dtype=dtype)

    def run_redco() -> float:
        trainer.set_train_state(step=0)  # so fit runs its epoch again
        t0 = time.perf_counter()
        trainer.fit(examples, per_device_batch_size=args.per_device_batch_size, n_epochs=1,
                    resume=False)  # fit reads the last step's metrics back: it ends in sync
        return time.perf_counter() - t0

    # ---- (b) hand-written jax.jit loop, same mesh / shardings / batches / optimizer ----------
    trainer.eval_loss(examples[:global_batch], args.per_device_batch_size)  # decides the layout
    params_sh, opt_sh = trainer.state_shardings.params, trainer.state_shardings.opt_state
    batch_sh = NamedSharding(deployer.mesh, P("dp"))
    hw_params = jax.device_put(jax.tree.map(np.copy, host_params), params_sh)
    hw_opt = jax.jit(optimizer.init, out_shardings=opt_sh)(hw_params)

    def train_step(params, opt_state, batch):
        def loss(p):
            p = jax.tree.map(lambda x: x.astype(dtype), p)
            ids = batch["input_ids"]
            logits = apply_fn(p, ids[:, :-1]).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    hw_step = jax.jit(train_step, in_shardings=(params_sh, opt_sh, batch_sh),
                      out_shardings=(params_sh, opt_sh, deployer.replicated),
                      donate_argnums=(0, 1))
    order = deployer.epoch_permutation(len(examples), 0)  # fit's epoch-0 order: same batches
    chunks = [[examples[j] for j in order[i * global_batch:(i + 1) * global_batch]]
              for i in range(args.steps)]
    placed = [jax.device_put(collate_fn(c), batch_sh) for c in chunks]
    hw = {"params": hw_params, "opt": hw_opt}

    def run_hw(preplaced: bool) -> float:
        t0 = time.perf_counter()
        p, o, loss = hw["params"], hw["opt"], None
        for i in range(args.steps):
            batch = placed[i] if preplaced else jax.device_put(collate_fn(chunks[i]), batch_sh)
            p, o, loss = hw_step(p, o, batch)
        float(loss)
        jax.block_until_ready((p, o))
        hw["params"], hw["opt"] = p, o
        return time.perf_counter() - t0

    redco_batches = [deployer.make_batch(c, collate_fn, n_micro=1) for c in chunks]

    def run_redco_step() -> float:  # redco's jitted step alone, without fit's host loop
        return time_steps(trainer, redco_batches)

    sides = {"redco Trainer.fit": run_redco,
             "redco step, bare loop": run_redco_step,
             "hand-written jit": lambda: run_hw(False),
             "hand-written, pre-placed": lambda: run_hw(True)}
    t0 = time.perf_counter()
    for fn in sides.values():  # warm-up: compile everything
        fn()
    warmup_s = time.perf_counter() - t0
    n_warmup_rows = len(train_rows(workdir))
    times = {name: [] for name in sides}
    names = list(sides)
    for r in range(args.repeats):  # alternate the order to spread drift and noise evenly
        for name in (names if r % 2 == 0 else names[::-1]):
            times[name].append(sides[name]())

    print()
    print(f"redco {redco.__version__} | jax {jax.__version__} | flax {flax.__version__} | "
          f"optax {optax.__version__} | python {platform.python_version()}")
    print(f"devices: {jax.device_count()} x {jax.devices()[0].platform} on {os.cpu_count()} "
          f"CPU cores | mesh {dict(deployer.mesh.shape)} | params {n_params:,} | "
          f"global batch {global_batch} x {args.seq_len} tokens")
    print(f"model: {config} | compute dtype {args.compute_dtype}")
    print(f"{args.repeats} timed repeats x {args.steps} steps each (warm-up {warmup_s:.1f}s)")
    print()
    flops_per_token = model_flops_per_token(config, args.seq_len)
    n_devices = jax.device_count()
    header = f"{'side':<26}{'steps/s (median)':>18}{'min':>9}{'max':>9}{'tokens/s':>12}"
    if args.peak_tflops:
        header += f"{'MFU':>8}"
        print(f"model FLOPs per token: {flops_per_token:.4g} (6N + 12LTd), peak "
              f"{args.peak_tflops:g} TFLOP/s per device, {n_devices} devices")
    print(header)
    print("-" * len(header))
    rates, best = {}, {}
    for name, ts in times.items():
        r = [args.steps / t for t in ts]
        rates[name], best[name] = statistics.median(r), max(r)
        tokens = rates[name] * global_batch * args.seq_len
        mfu = (f"{tokens * flops_per_token / (args.peak_tflops * 1e12 * n_devices):>8.1%}"
               if args.peak_tflops else "")
        print(f"{name:<26}{rates[name]:>18.2f}{min(r):>9.2f}{max(r):>9.2f}{tokens:>12,.0f}{mfu}")
    ours = "redco Trainer.fit"
    ratio = rates[ours] / rates["hand-written jit"]
    paired = {ref: statistics.median(b / a for a, b in zip(times[ours], times[ref]))
              for ref in ("hand-written jit", "hand-written, pre-placed")}
    print()
    print("paired ratio (median over repeats of redco/reference, each pair run back to back; "
          "the most load-robust figure):")
    for ref, value in paired.items():
        print(f"  redco / {ref:<26}{value:.3f}")
    print(f"ratio redco / hand-written jit:           {ratio:.3f} median, "
          f"{best[ours] / best['hand-written jit']:.3f} best  (aim >= 0.99: "
          f"{'OK' if ratio >= 0.99 else 'BELOW'})")
    print(f"ratio redco / hand-written, pre-placed:   "
          f"{rates[ours] / rates['hand-written, pre-placed']:.3f} median, "
          f"{best[ours] / best['hand-written, pre-placed']:.3f} best")

    if args.peak_tflops:
        print_logged_mfu(trainer, train_rows(workdir)[n_warmup_rows:], rates, global_batch,
                         flops_per_token, args)
    if args.collectives:
        import re
        hlos = {"redco Trainer.steps.train": trainer.steps.train.lower(
                    trainer.state, redco_batches[0]).compile().as_text(),
                "hand-written step": hw_step.lower(
                    hw["params"], hw["opt"], placed[0]).compile().as_text()}
        print()
        for name, hlo in hlos.items():
            counts = {op: len(re.findall(rf"= [^=]*? {op}(-start)?\(", hlo))
                      for op in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                                 "collective-permute")}
            print(f"collectives in {name}: {counts}")
    if args.profile:
        profile(trainer, deployer, run_redco, chunks, args)
    deployer.close()
    sys.stdout.flush()


def train_rows(workdir: str) -> list[dict]:
    """The rows ``fit`` logged to ``metrics.jsonl`` that carry an update's throughput."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [row for row in map(json.loads, f) if "perf/step_time_s" in row]


def print_logged_mfu(trainer, rows: list[dict], rates: dict, global_batch: int,
                     flops_per_token: float, args) -> None:
    """The MFU ``fit`` logged (``perf/mfu``: XLA's FLOPs of the step over the step's time and
    the peak of the device kind) against this bench's (model FLOPs over the measured rate)."""
    from redco.observers.throughput import peak_tflops
    tokens_per_step = global_batch * args.seq_len
    logged = statistics.median(row["perf/mfu"] for row in rows if "perf/mfu" in row)
    logged_time = statistics.median(row["perf/step_time_s"] for row in rows)
    print(f"\nlogged by fit over {len(rows)} timed updates (peak of a "
          f"{jax.devices()[0].device_kind!r}: {peak_tflops(jax.devices()[0])} TFLOP/s):")
    print(f"  perf/mfu median {logged:.2%}, perf/step_time_s median {logged_time:.4f} s")
    print(f"  step FLOPs, logged / 6N+12LTd: "
          f"{trainer.step_flops() / (flops_per_token * tokens_per_step):.4f}")
    for name in ("redco Trainer.fit", "redco step, bare loop"):
        bench = rates[name] * tokens_per_step * flops_per_token / (
            args.peak_tflops * 1e12 * jax.device_count())
        print(f"  logged MFU / this bench's MFU of {name!r} ({bench:.2%}): {logged / bench:.4f}")


def profile(trainer, deployer, run_redco, chunks, args) -> None:
    """Where the host time of one Trainer.fit goes, per step."""
    n = args.steps
    t0 = time.perf_counter()
    for c in chunks:
        deployer.make_batch(c, collate_fn, n_micro=1)
    make_batch_ms = (time.perf_counter() - t0) / n * 1e3
    t0 = time.perf_counter()
    for c in chunks:
        collate_fn(c)
    collate_ms = (time.perf_counter() - t0) / n * 1e3
    _, metrics = None, {"loss": jnp.zeros(()), "grad_norm": jnp.zeros(())}
    t0 = time.perf_counter()
    for _ in range(n):
        jax.device_get(metrics)
    device_get_ms = (time.perf_counter() - t0) / n * 1e3
    print()
    print("host-side costs per step (measured in isolation):")
    print(f"  collate_fn alone:                  {collate_ms:7.3f} ms")
    print(f"  Deployer.make_batch (incl. collate): {make_batch_ms:5.3f} ms")
    print(f"  device_get of a ready metrics dict: {device_get_ms:6.3f} ms")
    prof = cProfile.Profile()
    prof.enable()
    wall = run_redco()
    prof.disable()
    print(f"cProfile of one Trainer.fit ({n} steps, {wall / n * 1e3:.1f} ms/step under the "
          "profiler), top 25 by cumulative time:")
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(25)
    print(out.getvalue())


if __name__ == "__main__":
    from provenance import print_provenance
    print_provenance()
    main()
