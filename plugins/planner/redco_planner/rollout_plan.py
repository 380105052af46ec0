"""``redco plan --rollout_devices auto``: GRPO's split of the devices into a rollout mesh and a
training mesh for a round's shape, planned as ``redco zoo run grpo --rollout_devices auto``
plans it (``redco_zoo_grpo.rollout_split``: the engine's decode and prefill programs and the
train step compiled ahead of time on abstract params; the round's time estimated from their
compiled FLOPs and bytes). Needs the GRPO zoo package, imported only here."""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of a GRPO round's shape (``--seq_len`` is its prompts' width)."""
    add = parser.add_argument
    add("--rollout_devices", choices=("auto",), help="plan GRPO's asynchronous rollouts "
        "instead of a layout: how many of --devices sample (and their decode layout) with "
        "the least estimated round time where both the rollout and the update fit "
        "(redco_zoo_grpo.rollout_split); --seq_len is the prompts' width")
    add("--prompts_per_round", type=int, default=16, help="--rollout_devices: prompts a round")
    add("--n_samples", type=int, default=8, help="--rollout_devices: completions per prompt")
    add("--max_new_tokens", type=int, default=256, help="--rollout_devices: tokens a completion")
    add("--engine_rows", type=int, default=32, help="--rollout_devices: the engine's rows")
    add("--n_updates", type=int, default=1, help="--rollout_devices: epochs over a round")
    add("--max_off_policy_steps", type=int, default=1, help="--rollout_devices: K (0: the "
        "rollout and the update alternate; 1 or more: they overlap)")
    add("--n_model_shards", type=int, default=1, help="--rollout_devices: the trainer's")
    add("--decode_model_shards", default="auto", help="--rollout_devices: the rollout mesh's "
        "decode tensor-parallel degree (auto: the fastest that fits at each N)")


def run(args: argparse.Namespace) -> None:
    """Plan and print the split: every candidate's estimates, the pick and why."""
    try:
        from redco_zoo_grpo.auto_split import abstract_decoder, describe, grpo_loss
        from redco_zoo_grpo.pipeline import loss_fn
        from redco_zoo_grpo.rollout_split import RoundShape, plan_split
    except ImportError as e:
        raise ImportError("redco plan --rollout_devices needs GRPO's zoo package: pip install "
                          "redco-zoo-grpo (./zoo/grpo in the redco repository).") from e
    import jax.numpy as jnp

    from redco_planner.inspection import parse_bytes
    model, apply_fn, params, trainable = abstract_decoder(args.model, args.lora_rank or 0)
    shape = RoundShape(args.prompts_per_round, args.n_samples, args.seq_len,
                       args.max_new_tokens, args.engine_rows, args.per_device_batch_size,
                       args.n_updates, args.n_model_shards, args.rules.split(",")[0],
                       compute_dtype=None if args.compute_dtype == "float32" else jnp.bfloat16)
    print(f"{args.model}: GRPO rounds of {shape.prompts} prompts x {shape.samples} samples x "
          f"{shape.new_tokens} new tokens on {args.devices} "
          f"devices x {args.device_memory}; estimated from compiled FLOPs and bytes:")
    split = plan_split(model, params, grpo_loss(loss_fn, apply_fn), shape,
                       parse_bytes(args.device_memory), args.max_off_policy_steps,
                       args.decode_model_shards, trainable=trainable,
                       log=lambda line: print("  " + line, flush=True))
    print(describe(split), flush=True)
