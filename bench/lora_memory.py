"""Does LoRA hold what it promises? A device's bytes in the train step the ``Trainer`` compiles
(XLA's ``memory_analysis()``: arguments, temporaries, peak), for each remat policy and size:

  full     every param trained: params, AdamW's two moments and a gradient per param
  LoRA     the zoo's ``add_lora`` (rank ``--rank``), base frozen (``Trainer(trainable=...)``)
  naive    LoRA computing ``x @ W + ((x @ A) @ B) * s`` in plain ``jnp`` (the zoo's ``LoRALinear``
           before it marked the sum with ``redco.remat.matmul_output``): under a policy that keeps
           matmul outputs, both full-size products are kept
  frozen   the base frozen, no adapters, only the norms trained: the least a LoRA step can hold

What LoRA must hold (issue 24): peak(full) - peak(LoRA) >= 2 x the base's param bytes (AdamW's
moments, which LoRA does not keep for the base), and LoRA's temporaries <= full fine-tuning's
less the base's gradient bytes. Each line says whether it does.

    python bench/lora_memory.py [--sizes 512x4,1024x8 --batch 4 --seq_len 512]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile

POLICIES = ("none", "dots_saveable", "dots_with_no_batch_dims_saveable", "full")
KINDS = ("full", "LoRA", "naive", "frozen")
MB = 2 ** 20


@contextlib.contextmanager
def naive_lora():
    """``LoRALinear`` computing its projection in plain ``jnp``, nothing marked."""
    import jax.numpy as jnp
    from flax import nnx

    from redco_zoo_models.lora import LoRALinear

    def call(self, x):
        a, b = self.promote_dtype((self.lora_a[...], self.lora_b[...]), dtype=self.dtype)
        low = jnp.dot(jnp.dot(x, a, precision=self.precision), b, precision=self.precision)
        return nnx.Linear.__call__(self, x) + (low * self.scale).astype(x.dtype)
    marked = LoRALinear.__call__
    LoRALinear.__call__ = call
    try:
        yield
    finally:
        LoRALinear.__call__ = marked


def step_memory(kind: str, policy: str, hidden: int, layers: int, args) -> dict:
    """Bytes of one device in the compiled train step of ``kind`` under ``policy``."""
    with naive_lora() if kind == "naive" else contextlib.nullcontext():
        return _step_memory(kind, policy, hidden, layers, args)


def _step_memory(kind: str, policy: str, hidden: int, layers: int, args) -> dict:
    import jax
    import optax
    from flax import nnx
    from trainer_vs_jit import byte_sequences, collate_fn, loss_fn

    from redco import Deployer, Trainer, lora
    from redco.tree_paths import path_str
    from redco_zoo_models import LlamaConfig, LlamaForCausalLM, add_lora, split_model
    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, vocab_size=256,
                         intermediate_size=hidden * 11 // 4, num_attention_heads=hidden // 64,
                         num_key_value_heads=hidden // 64)
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    if kind in ("LoRA", "naive"):
        add_lora(model, rank=args.rank)
    apply_fn, params = split_model(model)
    trainable = {"full": None, "frozen": jax.tree_util.tree_map_with_path(
        lambda p, _: "norm" in path_str(p), params)}.get(kind, lora.trainable_mask(params))
    deployer = Deployer(jax_seed=0, n_model_shards=1, verbose=False,
                        workdir=tempfile.mkdtemp(prefix="redco-lora-memory-"))
    trainer = Trainer(deployer, collate_fn, apply_fn, loss_fn, params, optax.adamw(1e-3),
                      remat=policy, trainable=trainable)
    examples = byte_sequences(args.seq_len, deployer.get_global_batch_size(args.batch))
    m = trainer.compile_train_step(examples, args.batch).memory_analysis()
    base = sum(x.size * x.dtype.itemsize for p, x in lora.named_leaves(params)
               if not lora.is_adapter_path(p))
    return {"arguments": m.argument_size_in_bytes, "temp": m.temp_size_in_bytes, "base": base,
            "peak": m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes}


def verdict(full: dict, adapted: dict) -> str:
    """Whether LoRA's step holds the two promises, with the numbers."""
    base = full["base"]
    saved, least = full["peak"] - adapted["peak"], 2 * base
    temp, most = adapted["temp"], full["temp"] - base
    return (f"peak(full) - peak(LoRA) {saved / MB:7.1f} MB (>= 2 x base {least / MB:.1f}: "
            f"{'yes' if saved >= least else 'NO'}); LoRA temp {temp / MB:.1f} MB (<= full's less "
            f"the base's gradients {most / MB:.1f}: {'yes' if temp <= most else 'NO'})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="512x4,1024x8", help="HIDDENxLAYERS, comma-separated")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4, help="rows per device")
    parser.add_argument("--seq_len", type=int, default=512)
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from provenance import print_provenance
    print_provenance()
    for size in args.sizes.split(","):
        hidden, layers = map(int, size.split("x"))
        print(f"\nzoo LLaMA, hidden {hidden}, {layers} layers, {args.batch} x {args.seq_len} "
              f"tokens per device, fp32, AdamW, LoRA rank {args.rank}", flush=True)
        for policy in args.policies.split(","):
            rows = {kind: step_memory(kind, policy, hidden, layers, args) for kind in KINDS}
            for kind, row in rows.items():
                print(f"  {policy:32s} {kind:6s}  arguments {row['arguments'] / MB:8.1f}  temp "
                      f"{row['temp'] / MB:8.1f}  peak {row['peak'] / MB:8.1f} MB", flush=True)
            print(f"    LoRA:  {verdict(rows['full'], rows['LoRA'])}")
            print(f"    naive: {verdict(rows['full'], rows['naive'])}", flush=True)


if __name__ == "__main__":
    main()
