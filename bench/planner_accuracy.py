"""How well the planner's ahead-of-time estimate predicts the memory a train step really takes.

``redco_planner.planner.measure`` compiles the train step on abstract shapes and reads XLA's
``memory_analysis()``; nothing is allocated. Here the same model then really trains a few steps
through ``Trainer.fit`` and the device's own allocator reports its peak
(``memory_stats()['peak_bytes_in_use']``, GPUs and TPUs only). Run once on a GPU to see the
estimate against reality, and once on the CPU to see how far the CPU compiler's buffer
assignment (what ``redco plan`` uses on a laptop) is from the GPU's.

Run:  python bench/planner_accuracy.py [--preset llama-1b --seq_len 1024 --batch 2]
"""
from __future__ import annotations

import argparse
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from redco import Deployer, Trainer
from redco_planner.inspection import human_bytes
from redco_planner.measure import measure
from redco_planner.models import lm_loss
from redco_zoo_lm import collate_fn, loss_fn
from redco_zoo_models import LLAMA_PRESETS, LlamaConfig, LlamaForCausalLM, split_model


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-1b", choices=list(LLAMA_PRESETS))
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2, help="per-device batch size")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    config = LlamaConfig(**LLAMA_PRESETS[args.preset])
    optimizer = optax.adamw(1e-4)
    abstract = nnx.eval_shape(lambda: LlamaForCausalLM(config, rngs=nnx.Rngs(0)))
    apply_fn, params_abstract = split_model(abstract)
    n_params = sum(x.size for x in jax.tree.leaves(params_abstract))

    loss = lm_loss(apply_fn)
    batch = {"input_ids": jax.ShapeDtypeStruct((args.batch, args.seq_len + 1), jnp.int32)}
    layout = measure(params_abstract, loss, batch, n_devices=1, n_model_shards=1,
                     optimizer=optimizer)
    device = jax.devices()[0]
    print(f"{args.preset}: {n_params:,} params, fp32, AdamW, batch {args.batch} x "
          f"{args.seq_len}, 1 {device.platform} device ({device.device_kind})")
    print(f"planner estimate (AOT, {device.platform} compiler): peak "
          f"{human_bytes(layout.peak_bytes)} = arguments {human_bytes(layout.argument_bytes)} "
          f"+ outputs {human_bytes(layout.output_bytes)} - donated "
          f"{human_bytes(layout.alias_bytes)} + temp {human_bytes(layout.temp_bytes)}; "
          f"compiled in {layout.compile_s:.1f}s")
    if not (device.memory_stats() or {}).get("peak_bytes_in_use"):
        print("this device reports no allocator statistics: estimate only")
        return
    apply_fn, params = split_model(LlamaForCausalLM(config, rngs=nnx.Rngs(0)))
    deployer = Deployer(jax_seed=0, n_model_shards=1, workdir=tempfile.mkdtemp(),
                        n_local_devices=1, verbose=False, loggers=())
    trainer = Trainer(deployer, collate_fn, apply_fn, loss_fn, params, optimizer)
    del params
    rng = np.random.default_rng(0)
    examples = [{"token_ids": rng.integers(0, config.vocab_size, args.seq_len + 1)}
                for _ in range(args.steps * args.batch)]
    trainer.fit(examples, per_device_batch_size=args.batch, n_epochs=1)
    peak = device.memory_stats()["peak_bytes_in_use"]
    print(f"measured: allocator peak {human_bytes(peak)} over {args.steps} Trainer.fit steps "
          f"(initialisation included); estimate / measured = {layout.peak_bytes / peak:.3f}")


if __name__ == "__main__":
    from provenance import print_provenance
    print_provenance()
    main()
