"""The numbers behind the rematerialisation and LoRA-collective sentences of
docs/guides/lora-and-remat.md, from the train step a ``Trainer`` compiles (XLA's
``memory_analysis()``/``cost_analysis()`` on CPU, 8 simulated devices, dp4 x mp2, the zoo LLaMA: 8
layers, width 64, 128 tokens per device):

1. the remat table: temp bytes and FLOPs of the step under each ``redco.remat`` policy;
2. "a checkpoint around a whole loss_fn saves nothing": the same step, the model's layers not
   rematerialised, its whole ``loss_fn`` in ``jax.checkpoint(policy=...)`` instead;
3. "a bare ``jax.checkpoint`` per layer saves nothing on XLA CPU": each layer in a plain
   ``jax.checkpoint(policy=...)``, against ``redco.remat.layer``'s (whose recomputation is tied
   to the gradient from above);
4. the collectives of a LoRA step against full fine-tuning's: the compiled HLO's all-reduce,
   all-gather, reduce-scatter and all-to-all ops, with the shape each one moves.

    python bench/remat_claims.py        # about a minute; prints four tables
"""
from __future__ import annotations

import collections
import os
import re
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
POLICIES = ("none", "dots_saveable", "dots_with_no_batch_dims_saveable", "full")
N_LAYERS, WIDTH, SEQ_LEN = 8, 64, 128


def model(use_lora: bool):
    """``(apply_fn, params)`` of the zoo LLaMA (8 layers, width 64), with LoRA rank 8 or not."""
    import jax
    import numpy as np
    from flax import nnx

    from redco_zoo_models import LlamaConfig, LlamaForCausalLM, add_lora, split_model

    def make():
        m = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=WIDTH, intermediate_size=176,
                                         num_hidden_layers=N_LAYERS, num_attention_heads=4,
                                         num_key_value_heads=2), nnx.Rngs(0))
        return add_lora(m, rank=8) if use_lora else m
    apply_fn, shapes = split_model(nnx.eval_shape(make))
    rng = np.random.default_rng(0)
    return apply_fn, jax.tree.map(lambda s: (0.02 * rng.normal(size=s.shape)).astype(s.dtype), shapes)


def compiled_step(policy: str, use_lora: bool = False, loss_wrapper=None):
    """The Trainer's own train step (dp4 x mp2), compiled under remat ``policy``."""
    import numpy as np
    import optax

    from redco import Deployer, Trainer, lora, remat
    from redco_zoo_lm import collate_fn, loss_fn
    apply_fn, params = model(use_lora)
    trainer = Trainer(Deployer(jax_seed=0, n_model_shards=2, verbose=False, compile_cache_dir=False),
                      collate_fn, apply_fn, loss_wrapper(loss_fn) if loss_wrapper else loss_fn,
                      params, optax.adamw(1e-3),
                      trainable=lora.trainable_mask(params) if use_lora else None)
    examples = [{"token_ids": np.arange(SEQ_LEN + 1) % 256} for _ in range(8)]
    with remat.policy(policy):
        return trainer.compile_train_step(examples[:trainer.deployer.dp_size], 1)


def temp_and_flops(compiled) -> tuple[float, float]:
    return (compiled.memory_analysis().temp_size_in_bytes / 1e6,
            compiled.cost_analysis()["flops"] / 1e6)


def remat_table() -> None:
    print(f"1. remat policies: the zoo's {N_LAYERS}-layer LLaMA step (dp4 x mp2, {SEQ_LEN} tokens)")
    base = None
    for policy in POLICIES:
        temp, flops = temp_and_flops(compiled_step(policy))
        base = base or flops
        print(f"   {policy:34s} temp {temp:6.2f} MB  {flops:6.0f} MFLOP ({flops / base - 1:+.0%})")


def whole_loss_checkpoint() -> None:
    import jax

    from redco import remat
    print("2. jax.checkpoint around the whole loss_fn (no remat.layer): temp MB per policy")
    for policy in POLICIES:
        def wrap(loss_fn, saveable=remat.POLICIES[policy]):
            return jax.checkpoint(loss_fn, policy=saveable)
        temp, _ = temp_and_flops(compiled_step("none", loss_wrapper=wrap))
        print(f"   {policy:34s} temp {temp:6.2f} MB")


def bare_checkpoint_per_layer() -> None:
    import jax

    from redco import remat
    print("3. each layer in a bare jax.checkpoint vs redco.remat.layer (tied): temp MB")
    tied = remat._tied_checkpoint
    for policy in POLICIES[1:]:
        remat._tied_checkpoint = lambda fn, saveable, _: jax.checkpoint(fn, policy=saveable)
        bare, _ = temp_and_flops(compiled_step(policy))
        remat._tied_checkpoint = tied
        ours, _ = temp_and_flops(compiled_step(policy))
        print(f"   {policy:34s} bare {bare:6.2f}  remat.layer {ours:6.2f}")


def collectives(compiled) -> collections.Counter:
    """``{(op, array shape): count}`` over the compiled step's collectives, XLA's combined
    (tuple) ones counted per array they move."""
    found = collections.Counter()
    for line in compiled.as_text().splitlines():
        op = re.search(r"[)}\]] (all-reduce|all-gather|reduce-scatter|all-to-all)(-start)?\(", line)
        if op and " = " in line:
            moved = line.split(" = ", 1)[1][:op.start(1) - len(line.split(" = ", 1)[0]) - 3]
            for shape in re.findall(r"[a-z]+\d*\[[\d,]*\]", moved):
                found[(op.group(1), shape)] += 1
    return found


def lora_collectives() -> None:
    print("4. arrays moved by the step's collectives (dp4 x mp2): full fine-tuning vs LoRA rank 8")
    full, with_lora = collectives(compiled_step("none")), collectives(compiled_step("none", True))
    activations = [key for key in set(full) | set(with_lora) if key[1].startswith("f32[1,")]
    for key in sorted(activations):
        print(f"   {key[0]:15s} {key[1]:16s} full {full[key]:3d}  LoRA {with_lora[key]:3d}")
    dp_full = sum(full.values()) - sum(full[k] for k in activations)
    dp_lora = sum(with_lora.values()) - sum(with_lora[k] for k in activations)
    print(f"   (and the gradients' data-parallel all-reduce: {dp_full} arrays in full fine-tuning, "
          f"{dp_lora} with LoRA)")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from provenance import print_provenance
    print_provenance()
    remat_table()
    whole_loss_checkpoint()
    bare_checkpoint_per_layer()
    lora_collectives()
