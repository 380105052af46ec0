"""The longest sequence whose train step fits 8 devices of 80 GB, with and without context
parallelism, by ahead-of-time compilation on abstract shapes (nothing is allocated; the
planner's ``measure``: XLA's per-device peak of the whole step, params, gradients, AdamW state
and activations).

Models: LLaMA-7B (``redco_zoo_models.LLAMA_PRESETS``) and a Llama-3-8B-shaped LLaMA (hidden
4096, MLP 14336, 32 layers, 32 heads, 8 KV heads, vocab 128,256). One sequence per step
(global batch 1 per data-parallel group), fp32 weights and AdamW state, bf16 compute (as
``Trainer(compute_dtype=jnp.bfloat16)``), ``auto+fsdp`` rules
(weights and optimizer state sharded over every device), full remat (each layer's input kept,
the rest recomputed). Without CP: mp = 8 (tensor parallelism over all 8); with CP: cp = 8 (the
weights and optimizer state FSDP-sharded over the 8), each strategy. The sequence doubles from
``--start`` until the peak passes 90% of 80 GB (the planner's headroom).

The zoo's attention runs in tiles of 512 keys off a GPU's fused kernel, split or not
(``redco_zoo_models.tiled_attention``, flash attention's algorithm in plain JAX): a device holds
(its tokens x 512) scores per head, never (N/cp) x N; the loss goes through ``labels=``, 1,024
tokens' logits at a time (``redco_zoo_models.chunked_loss``).

Run:  python bench/context_parallel_longest.py [--models llama-7b,llama3-8b] [--start 8192]
          [--layouts "no CP (mp 8);CP 8, ring"] 2>/dev/null
(a ring layout compiles for about 5 minutes per length on 2 CPU cores: start it near its limit)
"""
from __future__ import annotations

import argparse
import os
import time

if __name__ == "__main__":  # before jax starts
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from redco_planner.layouts import usable_bytes  # noqa: E402
from redco_planner.measure import measure  # noqa: E402
from redco_zoo_models import LLAMA_PRESETS, LlamaConfig, LlamaForCausalLM, split_model  # noqa: E402

MODELS = {"llama-7b": LLAMA_PRESETS["llama-7b"],
          "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                            num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                            rope_theta=500000.0)}
LAYOUTS = {"no CP (mp 8)": (8, 1, "all_gather"), "CP 8, all-gather": (1, 8, "all_gather"),
           "CP 8, ring": (1, 8, "ring")}
MEMORY = 80 * 10**9


def model(name: str):
    """Abstract params and the next-token loss through ``labels=`` (the zoo model's chunked
    loss: the logits never exist whole)."""
    cfg = LlamaConfig(**MODELS[name])
    apply_fn, params = split_model(nnx.eval_shape(lambda: LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))))
    return params, lambda p, batch: apply_fn(p, batch["input_ids"][:, :-1],
                                             labels=batch["input_ids"][:, 1:])


def peak(params, loss, seq: int, mp: int, cp: int, strategy: str) -> float:
    batch = {"input_ids": jax.ShapeDtypeStruct((1, seq + 1), jnp.int32)}
    layout = measure(params, loss, batch, 8, mp, "auto+fsdp", remat="full",
                     n_context_shards=cp, context_strategy=strategy, compute_dtype=jnp.bfloat16)
    return layout.peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="llama-7b,llama3-8b")
    parser.add_argument("--start", type=int, default=8192)
    parser.add_argument("--stop", type=int, default=2**20, help="longest length tried")
    parser.add_argument("--layouts", default=";".join(LAYOUTS),
                        help="';'-separated, of: " + "; ".join(LAYOUTS))
    args = parser.parse_args()
    usable = usable_bytes(MEMORY)
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}; usable {usable / 1e9:.0f} GB of "
          f"{MEMORY / 1e9:.0f} GB per device")
    for name in args.models.split(","):
        params, loss = model(name)
        for label in args.layouts.split(";"):
            mp, cp, strategy = LAYOUTS[label]
            seq, longest = args.start, None
            while True:
                start = time.perf_counter()
                try:
                    bytes_ = peak(params, loss, seq, mp, cp, strategy)
                except Exception as e:  # noqa: BLE001 - printed: out of memory compiling
                    print(f"  {name:10} {label:26} {seq:>7} tokens: {type(e).__name__}", flush=True)
                    break
                print(f"  {name:10} {label:26} {seq:>7} tokens: peak {bytes_ / 1e9:6.1f} GB "
                      f"({time.perf_counter() - start:.0f}s)", flush=True)
                if bytes_ > usable:
                    break
                longest, seq = seq, seq * 2
                if seq > args.stop:
                    print(f"  (stopped: --stop {args.stop})", flush=True)
                    break
            print(f"{name} {label}: longest {longest} tokens", flush=True)


if __name__ == "__main__":
    main()
