"""``--rollout_devices auto`` in a run and in ``redco plan``: the abstract model and the round's
shape from the run's settings, handed to ``rollout_split.plan_split``; the run then uses the
pick as plain settings (``rollout_devices``, ``decode_model_shards``). Planned once, after the
prompts are rendered (their width is the round's) and before the model's weights are read."""
from __future__ import annotations

import dataclasses
import types
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from redco.lora import trainable_mask
from redco.protocols import UsageError
from redco_zoo_grpo.rollout_split import RoundShape, Speed, Split, plan_split


def abstract_decoder(model: str, lora_rank: int = 0, lora_alpha: float = 16.0) -> tuple:
    """``(model, apply_fn, params, trainable)`` of the zoo decoder ``model`` (a directory's
    ``config.json`` or a preset), built with ``nnx.eval_shape``: no weight allocated; with
    ``lora_rank``, the zoo's LoRA layers on it and only they trainable."""
    from redco_zoo_models import add_lora, split_model
    from redco_zoo_models.base_plan import decoder_config
    from redco_zoo_models.decoder import DecoderLM
    cfg = decoder_config(model, "--rollout_devices auto", "give --rollout_devices a number")

    def build():
        decoder = DecoderLM(cfg, rngs=nnx.Rngs(0))
        return add_lora(decoder, lora_rank, lora_alpha) if lora_rank else decoder
    abstract = nnx.eval_shape(build)
    apply_fn, params = split_model(abstract)
    return abstract, apply_fn, params, trainable_mask(params) if lora_rank else None


def grpo_loss(loss_fn: Callable, apply_fn: Callable, **loss_kwargs) -> Callable:
    """``loss(params, batch)``: the pipeline's ``loss_fn`` as ``Trainer`` calls it."""
    return partial(loss_fn, None, types.SimpleNamespace(apply_fn=apply_fn),
                   is_training=True, **loss_kwargs)


def memory_of(device_memory: str | None) -> int:
    """One device's bytes: ``--device_memory``, else what the device reports; refused naming
    the flag where neither is there (CPUs report none)."""
    from redco_planner.inspection import parse_bytes
    if device_memory is not None:
        return parse_bytes(device_memory)
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    if limit is None:
        raise UsageError(f"--rollout_devices auto needs one device's memory, and "
                         f"{jax.devices()[0].platform} devices do not report it: give "
                         "--device_memory (e.g. 80GB).")
    return int(limit)


def planned(config, prompt_len: int, loss_fn: Callable, log=print, speed: Speed = Speed()):
    """``config`` (a ``RunConfig[GRPORun]``) with the split chosen in place of ``auto`` (as
    given where it names a number); ``log`` gets the candidates' table, the pick and why."""
    run = config.task
    if run.asynchronous.rollout_devices != "auto":
        return config
    try:
        import redco_planner.measure  # noqa: F401 - the train step compiled as Trainer does
    except ImportError as e:
        raise ImportError("--rollout_devices auto needs the layout planner: pip install "
                          "redco-planner (./plugins/planner in the redco repository).") from e
    model, apply_fn, params, trainable = abstract_decoder(
        config.source.model, config.lora.rank, config.lora.alpha)
    split = plan_split(model, params, grpo_loss(loss_fn, apply_fn,
                                                **run.algorithm.loss_kwargs()),
                       round_shape(config, prompt_len), memory_of(config.layout.device_memory),
                       run.asynchronous.max_off_policy_steps, run.decode_model_shards, speed,
                       trainable, log=lambda line: log("  " + line))
    log(describe(split))
    return dataclasses.replace(config, task=dataclasses.replace(
        run, decode_model_shards=split.decode_model_shards,
        asynchronous=dataclasses.replace(run.asynchronous,
                                         rollout_devices=split.rollout_devices)))


def describe(split: Split) -> str:
    return (f"planned before loading: --rollout_devices {split.rollout_devices}, "
            f"--decode_model_shards {split.decode_model_shards} (estimated from compiled "
            f"FLOPs and bytes: rollout_split.py)\nwhy: {split.reason()}")


def round_shape(config, prompt_len: int) -> RoundShape:
    """What a round of ``config`` runs (``RoundShape``), its prompts ``prompt_len`` wide."""
    run, algo, layout = config.task, config.task.algorithm, config.layout
    return RoundShape(
        prompts=run.prompts_per_round, samples=algo.n_samples, prompt_len=prompt_len,
        new_tokens=algo.max_new_tokens, engine_rows=run.engine_rows,
        per_device_batch_size=config.loop.per_device_batch_size, n_updates=algo.n_updates,
        n_model_shards=layout.n_model_shards, sharding_rules=layout.sharding_rules,
        remat=layout.remat, beta=algo.beta,
        compute_dtype=None if layout.compute_dtype == "float32" else jnp.bfloat16)
