"""What each memory lever costs in speed: training throughput of full fine-tuning, LoRA and
rematerialisation, side by side on the same model, batch and device.

Each lever trains in its own process (so each reports its own allocator peak): the zoo's LLaMA
(``--preset``, TinyLlama-1.1B's shape by default) on byte tokens of ``pydoc_data.topics``,
``Trainer(compute_dtype=..., remat=..., trainable=...)`` with fp32 params and AdamW, its step
compiled ahead of time (``Trainer.compile_train_step``), one warm-up step, then ``--repeats``
timed runs of ``--steps`` of that step over batches already on the device. Levers (``--levers``):

  full            every param trained (the reference)
  full+POLICY     the same under ``Trainer(remat=POLICY)`` (``dots_saveable``, ``full``, ...)
  lora            ``redco_zoo_models.add_lora`` (rank ``--lora_rank``): the base frozen, only
                  adapters get gradients and optimizer state
  lora+POLICY     LoRA with that remat policy
  lora@FMT        LoRA over a frozen base quantised to ``FMT`` (``nf4``, ``int8``, ``fp8``;
                  ``redco_zoo_models.quantized_linear``, QLoRA): the attention and MLP kernels
                  held quantised and dequantised inside the step
  LEVER/scan      the same with the layers stored stacked and scanned (``scan_layers=True``)
  LEVER/scanN     scanned, ``N`` layers a step of the scan (``scan_unroll=N``)

Printed per lever: steps/s (median), tokens/s and its ratio to ``full``; MFU, model FLOPs per
token = 6N + 12LTd as in ``trainer_vs_jit.py`` (the same for every lever, so a lever that
computes more for the same tokens, as remat does, shows as a lower MFU); the device
allocator's peak (``peak_bytes_in_use``, where the device reports it; the process runs
nothing but the train step); and the seconds of ``Trainer.compile_train_step`` (deciding the
layout, tracing, lowering, compiling).

    python bench/lever_throughput.py --preset llama-1b --compute_dtype bfloat16 \\
        --peak_tflops 989 --seq_len 2048 --per_device_batch_size 8
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

LEVERS = ("full", "full+dots_saveable", "full+full", "lora", "lora+dots_saveable", "lora+full")


def parse_lever(lever: str) -> tuple[bool, str | None, str, int]:
    """``"lora@nf4+full/scan2"`` -> ``(True, "nf4", "full", 2)``: LoRA or not, the base's
    quantised format (None: as trained), the remat policy, and the layers a step of the scan
    (0: unrolled, ``/scan``: 1)."""
    body, _, layout = lever.partition("/")
    body, _, policy = body.partition("+")
    kind, _, fmt = body.partition("@")
    unroll = layout[len("scan"):] if layout.startswith("scan") else "-"
    scanned = unroll == "" or unroll.isdigit() and int(unroll) > 0
    if kind not in ("full", "lora") or not (layout == "" or scanned) or (fmt and kind != "lora") \
            or fmt not in ("", "nf4", "int8", "fp8"):
        raise ValueError(f"Unknown lever {lever!r}: use full or lora, lora@nf4|int8|fp8, each "
                         "with an optional +POLICY (remat) and /scan or /scanN.")
    return kind == "lora", fmt or None, policy or "none", int(unroll or 1) if layout else 0


def worker(lever: str, args: argparse.Namespace) -> dict:
    """Train ``lever`` in this process; its measurements as a dict."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from trainer_vs_jit import byte_sequences, collate_fn, loss_fn, model_flops_per_token

    from redco import Deployer, Trainer, lora
    from redco_zoo_models import LLAMA_PRESETS, LlamaConfig, LlamaForCausalLM, add_lora, split_model
    from redco_zoo_models.quantized_linear import quantize_linears
    from redco_zoo_models.runner import params_rules
    use_lora, fmt, policy, scan = parse_lever(lever)
    shape = LLAMA_PRESETS[args.preset] if args.preset else dict(
        hidden_size=args.hidden_size, num_hidden_layers=args.n_layers,
        intermediate_size=args.hidden_size * 11 // 4)
    config = LlamaConfig(**shape, scan_layers=scan > 0, scan_unroll=max(scan, 1))
    deployer = Deployer(jax_seed=0, n_model_shards=args.n_model_shards,
                        workdir=tempfile.mkdtemp(prefix="redco-levers-"), verbose=False)
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    if fmt:
        quantize_linears(model, fmt)
    if use_lora:
        add_lora(model, rank=args.lora_rank)
    apply_fn, params = split_model(model)
    rules = params_rules(model, params, deployer)  # a quantised kernel's scales with its codes
    del model
    trainable = lora.trainable_mask(params) if use_lora else None
    trainer = Trainer(deployer, collate_fn, apply_fn, loss_fn, params,
                      optax.adamw(1e-3, weight_decay=0.01), compute_dtype=jnp.dtype(args.compute_dtype),
                      remat=policy, trainable=trainable, params_sharding_rules=rules)
    global_batch = deployer.get_global_batch_size(args.per_device_batch_size)
    examples = byte_sequences(args.seq_len, (args.steps + 1) * global_batch)
    t0 = time.perf_counter()
    step = trainer.compile_train_step(examples[:global_batch], args.per_device_batch_size)
    compile_s = time.perf_counter() - t0
    batches = [deployer.make_batch(examples[i * global_batch:(i + 1) * global_batch], collate_fn,
                                   n_micro=1) for i in range(args.steps + 1)]
    state, loss = run_steps(step, trainer.state, batches[:1])  # warm-up
    seconds = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        state, loss = run_steps(step, state, batches[1:])
        seconds.append(time.perf_counter() - t0)
    stats = jax.devices()[0].memory_stats() or {}
    return {"lever": lever, "steps_per_s": statistics.median(args.steps / s for s in seconds),
            "tokens_per_step": global_batch * args.seq_len, "n_devices": jax.device_count(),
            "model_flops_per_token": model_flops_per_token(config, args.seq_len),
            "compile_s": compile_s,
            "peak_bytes": stats.get("peak_bytes_in_use"),
            "trainable": lora.n_params(params, trainable), "params": lora.n_params(params),
            "loss": loss}


def run_steps(step, state, batches: list) -> tuple:
    """``step`` over ``batches`` (already placed) until the last state is ready: (state, the
    last loss)."""
    import jax
    metrics = None
    for batch in batches:
        state, metrics = step(state, batch)
    loss = float(metrics["loss"])
    jax.block_until_ready(state)
    return state, loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levers", default=",".join(LEVERS))
    parser.add_argument("--preset", default="llama-1b", help="a LLAMA_PRESETS name, or '' for "
                        "--hidden_size / --n_layers")
    parser.add_argument("--hidden_size", type=int, default=128)
    parser.add_argument("--n_layers", type=int, default=2)
    parser.add_argument("--lora_rank", type=int, default=8)
    parser.add_argument("--compute_dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--peak_tflops", type=float, help="the device's peak, for MFU")
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--per_device_batch_size", type=int, default=8)
    parser.add_argument("--n_model_shards", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args)), flush=True)
        return
    for lever in args.levers.split(","):
        parse_lever(lever)  # a typo fails before any compile
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from provenance import print_provenance
    print_provenance()
    rows = []
    for lever in args.levers.split(","):
        out = subprocess.run([sys.executable, os.path.abspath(__file__), *sys.argv[1:],
                              "--worker", lever], capture_output=True, text=True)
        if out.returncode:
            print(f"{lever}: failed\n{out.stderr[-3000:]}", flush=True)
            continue
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    print_table(rows, args)


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    full = next((r for r in rows if r["lever"] == "full"), rows[0] if rows else None)
    if full is None:
        return
    peak = (args.peak_tflops or float("nan")) * 1e12
    print(f"\n{args.preset or 'custom'}, {args.per_device_batch_size} x {args.seq_len} tokens per "
          f"device and step, {args.compute_dtype} compute, fp32 params and AdamW, LoRA rank "
          f"{args.lora_rank}\n| lever | trained params | steps/s | tokens/s | / full | MFU "
          "| peak memory | compile s |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    full_tokens = full["steps_per_s"] * full["tokens_per_step"]
    for r in rows:
        tokens = r["steps_per_s"] * r["tokens_per_step"]
        mfu = tokens * r["model_flops_per_token"] / (peak * r["n_devices"])
        memory = "n/a" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.2f} GiB"
        print(f"| {r['lever']} | {r['trainable'] / r['params']:.2%} | {r['steps_per_s']:.2f} | "
              f"{tokens:,.0f} | {tokens / full_tokens:.2f} | {mfu:.1%} | {memory} | "
              f"{r['compile_s']:.1f} |")


if __name__ == "__main__":
    main()
