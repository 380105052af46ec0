"""``--rollout_devices auto`` in a run and in ``redco plan``: the abstract model and the round's
shape from the run's settings, handed to ``rollout_split.plan_split``; the run then uses the
pick as plain settings (``rollout_devices``, ``decode_model_shards``). Planned once, after the
prompts are rendered (their width is the round's) and before the model's weights are read; with
several processes, whose devices are known only once they joined, when the trainer's
``Deployer`` joins them (``AfterJoin``): N then a multiple of the processes, process 0's pick
taken by all."""
from __future__ import annotations

import dataclasses
import types
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from redco.lora import trainable_mask
from redco.protocols import UsageError
from redco_zoo_grpo.rollout_split import RoundShape, Speed, Split, plan_split


def abstract_decoder(model: str, lora_rank: int = 0, lora_alpha: float = 16.0) -> tuple:
    """``(model, apply_fn, params, trainable)`` of the zoo decoder ``model`` (a directory's
    ``config.json`` or a preset), built with ``nnx.eval_shape``: no weight allocated; with
    ``lora_rank``, the zoo's LoRA layers on it and only they trainable. Its layers unrolled
    (``scan_layers=False``): the split's seconds are XLA's cost analysis of its programs, which
    counts a loop's body once, a scanned stack's bytes and FLOPs for one layer."""
    from redco_zoo_models import add_lora, split_model
    from redco_zoo_models.base_plan import decoder_config
    from redco_zoo_models.decoder import DecoderLM
    cfg = dataclasses.replace(decoder_config(model, "--rollout_devices auto",
                                             "give --rollout_devices a number"), scan_layers=False)

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


def planned(config, prompt_len: int, loss_fn: Callable, log=print, speed: Speed = Speed(),
            devices: list | None = None):
    """``config`` (a ``RunConfig[GRPORun]``) with the split of ``devices`` (default: all)
    chosen in place of ``auto`` (as given where it names a number); ``log`` gets the
    candidates' table, the pick and why."""
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
                       trainable, log=lambda line: log("  " + line), devices=devices)
    log(describe(split))
    return with_split(config, split.rollout_devices, split.decode_model_shards)


def with_split(config, rollout_devices: int, decode_model_shards: int):
    """``config`` with the split in place of ``auto``."""
    run = config.task
    return dataclasses.replace(config, task=dataclasses.replace(
        run, decode_model_shards=decode_model_shards,
        asynchronous=dataclasses.replace(run.asynchronous, rollout_devices=rollout_devices)))


PLAN_TIMEOUT_MS = 3_600_000  # how long the other processes wait for process 0's planning


class AfterJoin:
    """``Deployer(devices=)`` for ``--rollout_devices auto`` with several processes: once the
    processes joined (the model's weights read by then), process 0 ``planned`` the split of
    every device of the run, the others waiting at the coordination service (no device
    collective held while it compiles), then all take its pick (a broadcast); returns the
    training devices. ``config`` then holds the pick, ``said`` the lines to log."""

    def __init__(self, config, prompt_len: int, loss_fn: Callable, speed: Speed = Speed()):
        self.config, self.prompt_len, self.loss_fn, self.speed = config, prompt_len, loss_fn, speed
        self.said: list[str] = []

    def __call__(self, devices: list) -> list:
        from jax.experimental import multihost_utils

        from redco import _private
        from redco_zoo_grpo.async_rollouts import rollout_devices
        first, failed = jax.process_index() == 0, None
        if first:
            try:
                self.config = planned(self.config, self.prompt_len, self.loss_fn,
                                      self.said.append, self.speed, devices)
            except Exception as e:  # (every process must still reach the broadcast below)
                failed = e
        _private.wait_at_barrier(_private.coordination_client(), "redco-grpo/rollout-split",
                                 PLAN_TIMEOUT_MS)
        run = self.config.task
        pick = [-1, -1] if failed else \
            [run.asynchronous.rollout_devices, run.decode_model_shards] if first else [0, 0]
        n, mp = (int(x) for x in multihost_utils.broadcast_one_to_all(np.array(pick, np.int32)))
        if failed:
            raise failed
        if n < 0:
            raise UsageError("--rollout_devices auto: process 0 found no split (its log says "
                             "why); give --rollout_devices N, a multiple of the processes.")
        self.config = with_split(self.config, n, mp)
        return rollout_devices(n, devices=devices)[0]


def describe(split: Split) -> str:
    when = "before loading" if split.processes == 1 else \
        f"once the {split.processes} processes joined"
    return (f"planned {when}: --rollout_devices {split.rollout_devices}, "
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
