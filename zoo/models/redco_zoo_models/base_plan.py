"""A zoo run's layout and quantised base, planned before the model is loaded
(``--n_model_shards auto --quantize_base auto|nf4|int8|fp8 --lora_rank r``).

A quantised base is decided before its weights are read (``from_pretrained`` quantises each
tensor as it loads it), so it cannot wait for ``Trainer.fit``'s first batch, where the layout
planner decides other runs' layouts. ``planned(config, seq_len)`` asks the planner
(``redco_planner.planner.plan``) once, on the zoo decoder built abstractly from the run's
``config.json`` or preset (``redco_planner.models.zoo_decoder``: the next-token loss on
``per_device_batch_size`` rows of ``seq_len`` tokens, the run's remat policy, compute dtype
and micro-batches): LoRA of rank r over the unquantised base first, then over the quantised one
(``auto``: int8, then nf4; a named format: only it; ``redco_planner.qlora``), each at
``n_model_shards`` 1, 2, ... and the ``auto`` then ``auto+fsdp`` rules. The run then uses what
it chose, as plain settings: ``quantize_base`` (None where the unquantised base fits),
``n_model_shards``, ``sharding_rules`` and ``remat``. Nothing is planned again.

Only decoders are planned this way (the planner builds the zoo's ``DecoderLM``); the ``lm`` and
``sft`` pipelines call it, the others refuse a quantised base with ``--n_model_shards auto``.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp

from redco.lora import trainable_mask
from redco.protocols import UsageError
from redco_zoo_models.decoder_config import DecoderConfig
from redco_zoo_models.hf import class_of
from redco_zoo_models.llama import LLAMA_PRESETS, LlamaConfig
from redco_zoo_models.presets import PRESETS, preset
from redco_zoo_models.settings import LoRA, RunConfig


def needs_plan(config: RunConfig) -> bool:
    """Whether the run's quantised base is left to the planner (``--n_model_shards auto``)."""
    return config.layout.n_model_shards == "auto" and bool(config.source.quantize_base)


def decoder_config(model: str, planned: str = "--quantize_base with --n_model_shards auto",
                   fix: str = "give --n_model_shards a number") -> DecoderConfig:
    """The decoder config of ``model``: a directory's ``config.json`` or a preset's; another
    family is refused, saying what is ``planned`` (decoders only) and the ``fix``."""
    path = os.path.join(model, "config.json")
    if os.path.isfile(path):
        with open(path) as f:
            config = json.load(f)
    elif model in PRESETS:
        config = preset(model)
    elif model in LLAMA_PRESETS:
        config = LlamaConfig(**LLAMA_PRESETS[model]).to_hf()
    else:
        raise UsageError(f"--model {model}: neither a directory with config.json nor a preset.")
    config_class = class_of(config, model).config_class
    if not issubclass(config_class, DecoderConfig):
        raise UsageError(f"{planned} plans decoders only; {model} is a "
                         f"{config_class.__name__}: {fix}.")
    return config_class.from_hf(config)


def lora_models(model, lora: LoRA) -> tuple[Any, Callable]:
    """The abstract ``model``'s (``zoo_decoder``'s) LoRA of the run's rank on the run's
    ``--lora_targets`` over the unquantised base, and ``(rank, format) ->`` the same over a
    quantised one: what the planner measures is what the run trains."""
    return (model.lora(lora.rank, lora.targets),
            functools.partial(model.quantized, targets=lora.targets))


def planned(config: RunConfig, seq_len: int, log=print) -> RunConfig:
    """``config`` with the planner's choice (module docstring) in place of ``auto``, or as
    given where nothing is left to the planner; ``log`` gets each layout tried and the pick."""
    if not needs_plan(config):
        return config
    try:
        from redco_planner.layouts import training
        from redco_planner.models import zoo_decoder
        from redco_planner.planner import memory_bytes, plan
    except ImportError as e:
        raise ImportError("--n_model_shards auto needs the layout planner: pip install "
                          "redco-planner (./plugins/planner in the redco repository).") from e
    layout, rank = config.layout, config.lora.rank
    model = zoo_decoder(decoder_config(config.source.model), seq_len)
    adapters, quantized = lora_models(model, config.lora)
    result = plan(adapters.params, adapters.loss, model.batch(config.loop.per_device_batch_size),
                  jax.device_count(), memory_bytes(layout.device_memory, jax.devices()[0]),
                  trainable=trainable_mask(adapters.params), lora_rank=rank,
                  quantize_base=config.source.quantize_base, quantized=quantized,
                  remat_policies=(layout.remat,), context_degrees=(layout.n_context_shards,),
                  accumulate_grad_batches=config.loop.accumulate_grad_batches,
                  compute_dtype=None if layout.compute_dtype == "float32" else jnp.bfloat16,
                  log=lambda line: log("  " + line))
    log(f"planned before loading: {training(result)}, n_model_shards={result.n_model_shards}, "
        f"sharding_rules={result.sharding_rules!r}, remat={result.remat!r}\n"
        f"why: {result.reason}")
    return dataclasses.replace(
        config, source=dataclasses.replace(config.source, quantize_base=result.quantize_base),
        layout=dataclasses.replace(layout, n_model_shards=result.n_model_shards,
                                   sharding_rules=result.sharding_rules, remat=result.remat))
