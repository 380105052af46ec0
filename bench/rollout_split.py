"""The planner's GRPO rollout split (``redco_zoo_grpo.rollout_split``) for published shapes on
8 x 80 GB, by AOT on 8 simulated CPU devices: no weight is allocated, every program is compiled
on abstract params. Prints, per model, every candidate N (rollout devices) with each side's
estimated seconds and compiled per-device peak, whether it fits, the round time with K = 1,
the pick and the seconds the planning took. The seconds are a roofline estimate on an H100's
speeds from XLA's cost analysis of CPU-compiled programs (rollout_split.py's docstring), not a
measurement.

    python bench/rollout_split.py [--models llama-3.2-1b,llama-3.1-8b] [--counts 4,6,7]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from provenance import print_provenance  # noqa: E402

# a round: 64 prompts x 8 samples of 512 new tokens after 256 prompt tokens, 64 engine rows;
# the trainer: minibatches of 1 row per device, FSDP over its devices (no full copy fits 80 GB
# at 8B: 128 GB of fp32 params and AdamW state)
SHAPE = dict(prompts=64, samples=8, prompt_len=256, new_tokens=512, engine_rows=64,
             per_device_batch_size=1, sharding_rules="auto+fsdp")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama-3.2-1b,llama-3.1-8b")
    parser.add_argument("--counts", default="4,6,7", help="the N tried (the others cannot "
                        "split 512 samples into minibatches of 1 x 8 - N rows)")
    parser.add_argument("--decode_model_shards", default="auto")
    parser.add_argument("--k", type=int, default=1)
    args = parser.parse_args()
    from redco_planner.commands import simulate_devices
    simulate_devices(8)
    print_provenance()
    from redco_zoo_grpo.auto_split import abstract_decoder, describe, grpo_loss
    from redco_zoo_grpo.pipeline import loss_fn
    from redco_zoo_grpo.rollout_split import RoundShape, plan_split
    shape = RoundShape(**SHAPE)
    print(f"round: {SHAPE}; K={args.k}; 8 x 80 GB")
    for name in args.models.split(","):
        start = time.perf_counter()
        model, apply_fn, params, _ = abstract_decoder(name)
        print(f"\n{name}:", flush=True)
        split = plan_split(model, params, grpo_loss(loss_fn, apply_fn), shape, 80 * 2 ** 30,
                           args.k, args.decode_model_shards,
                           counts=[int(n) for n in args.counts.split(",")],
                           log=lambda line: print("  " + line, flush=True))
        print(describe(split))
        print(f"planned in {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
