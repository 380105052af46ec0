"""Abstract models for planning: ``Model`` (params as shapes, a trace and a loss, and how to add
LoRA or a quantised base) and the zoo's decoders built as one (``zoo_decoder``, ``zoo_llama``,
``zoo_preset``), with no weight allocated. ``redco_zoo_models`` is imported only when a zoo model
is asked for, and fails with the ``pip install`` line that fixes it."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp


@dataclass
class Model:
    """An abstract model: ``params`` (``jax.ShapeDtypeStruct`` leaves), ``trace_fn(params)`` to
    read the dataflow from (or None), and for planning ``loss_fn(params, batch) -> scalar`` with
    ``batch(rows)``, the abstract batch of ``rows`` examples (or None)."""
    params: Any
    trace_fn: Callable | None = None
    loss_fn: Callable | None = None
    batch: Callable[[int], Any] | None = None
    lora: Callable[..., LoraModel] | None = None  # (rank, targets=None) -> with LoRA adapters
    quantized: Callable[..., LoraModel] | None = None  # (rank, format, targets=None) -> QLoRA's
    scanned: bool = False  # its layers stored stacked, run under jax.lax.scan


class LoraModel(NamedTuple):
    """A model with LoRA adapters, for planning: ``params`` (abstract, adapters named as in
    ``redco.lora``), ``loss(params, batch)``, ``via``: how the adapters were made, and
    ``overrides(rules by name) -> rules`` checked before the rule set's (a quantised base's
    parts, which the dataflow does not see through), or None."""
    params: Any
    loss: Callable
    via: str
    overrides: Callable[[list], list] | None = None


def lm_loss(apply_fn: Callable) -> Callable:
    """Mean next-token cross-entropy of ``apply_fn(params, ids) -> logits`` on ``input_ids``."""
    import optax

    def loss_fn(params, batch):
        ids = batch["input_ids"]
        logits = apply_fn(params, ids[:, :-1]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()
    return loss_fn


def zoo_models():
    """``redco_zoo_models``, imported only when a preset (``llama-*``, ``qwen3-*``, ...) is asked
    for."""
    try:
        import redco_zoo_models
        import redco_zoo_models.decoder  # noqa: F401 - DecoderConfig, DecoderLM
        import redco_zoo_models.presets  # noqa: F401 - the published decoders, by name
        import redco_zoo_models.quantized_linear  # noqa: F401 - QLoRA's frozen base
    except ImportError as e:
        raise ImportError("The preset models (llama-*, qwen3-*, gemma-3-*, phi-4-mini) come "
                          "from the zoo: pip install redco-zoo-models (./zoo/models in the redco "
                          "repository), or pip install 'redco-planner[presets]'.") from e
    return redco_zoo_models


def zoo_decoder(cfg, seq_len: int = 128, scan_layers: bool | None = None) -> Model:
    """The zoo's decoder (``redco_zoo_models.decoder.DecoderLM``) of config ``cfg``, built
    abstractly with ``nnx.eval_shape``: no weight is allocated. Its loss is the next-token
    cross-entropy over whole logits (``lm_loss``), as the zoo's LM and SFT pipelines compute it;
    ``lora(rank, targets)`` gives it the zoo's native LoRA layers on the kernels the regex
    ``targets`` selects (None: the attention and MLP projections), ``quantized(rank, fmt,
    targets)`` the same over a base whose projections are ``fmt`` codes and scales
    (``redco_zoo_models.quantized_linear``, QLoRA). ``scan_layers``: its layers stored stacked
    and run under ``jax.lax.scan`` (``redco_zoo_models.layer_scan``; None: wherever the model
    can, as ``DecoderConfig`` decides)."""
    import dataclasses

    from flax import nnx
    zoo = zoo_models()
    cfg = dataclasses.replace(cfg, scan_layers=scan_layers)
    build = lambda: zoo.decoder.DecoderLM(cfg, rngs=nnx.Rngs(0))  # noqa: E731
    apply_fn, params = zoo.split_model(nnx.eval_shape(build))

    def with_lora(rank: int, targets: str | None = None) -> LoraModel:
        lora_apply, lora_params = zoo.split_model(nnx.eval_shape(
            lambda: zoo.add_lora(build(), rank, targets=targets or zoo.lora.DEFAULT_TARGETS)))
        return LoraModel(lora_params, lm_loss(lora_apply),
                         "redco_zoo_models.add_lora: native LoRALinear layers")

    def with_quantized_lora(rank: int, fmt: str, targets: str | None = None) -> LoraModel:
        quantized = zoo.quantized_linear

        def build_quantized():
            model = build()
            quantized.quantize_linears(model, fmt)
            return zoo.add_lora(model, rank, targets=targets or zoo.lora.DEFAULT_TARGETS)
        model = nnx.eval_shape(build_quantized)
        q_apply, q_params = zoo.split_model(model)
        return LoraModel(q_params, lm_loss(q_apply), f"redco_zoo_models.add_lora over "
                         f"{fmt.upper()} QuantizedLinear projections",
                         lambda by_name: quantized.part_rules(model, by_name)
                         + zoo.quantized_experts.part_rules(model, by_name))
    return Model(params=params,
                 trace_fn=lambda p: apply_fn(p, jnp.zeros((1, 8), jnp.int32)),
                 loss_fn=lm_loss(apply_fn),
                 batch=lambda rows: {"input_ids": jax.ShapeDtypeStruct((rows, seq_len + 1),
                                                                       jnp.int32)},
                 lora=with_lora, quantized=with_quantized_lora, scanned=cfg.scan_layers)


def zoo_llama(seq_len: int = 128, scan_layers: bool | None = None, **config) -> Model:
    """The zoo LLaMA with ``config`` overriding ``LlamaConfig``'s defaults (``zoo_decoder``)."""
    return zoo_decoder(zoo_models().LlamaConfig(**config), seq_len, scan_layers)


def zoo_preset(name: str, seq_len: int = 128, scan_layers: bool | None = None, **overrides) -> Model:
    """A published decoder of ``redco_zoo_models.presets.PRESETS`` (``qwen3-8b``, ...), its
    ``config.json`` read by ``DecoderConfig.from_hf``; ``overrides`` replace config.json keys
    (e.g. ``vocab_size``)."""
    zoo = zoo_models()
    config = {**zoo.presets.preset(name), **overrides}
    return zoo_decoder(zoo.decoder.DecoderConfig.from_hf(config), seq_len, scan_layers)


def n_positional(fn: Callable) -> int:
    """How many positional parameters ``fn`` takes (so a loss can be told from a trace fn)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 1
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in kinds for p in params)
