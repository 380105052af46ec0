"""HuggingFace checkpoints in and out: ``config.json`` plus ``model.safetensors``.

The zoo's models name their modules and parameters as HuggingFace's PyTorch models do, so one
rule maps every parameter both ways: ``redco_safetensors.torch_name``, the rule of the
``safetensors`` checkpoint format (``kernel`` -> ``weight``, transposed; ``embedding``/``scale``
-> ``weight``). A model class provides ``config_class`` (a dataclass with ``from_hf(dict)`` and
``to_hf() -> dict``) and optionally ``base_model_prefix``, HuggingFace's, to read checkpoints of
the bare base model too, and ``hf_tied_weights`` (``{name: source}``), tensors to copy when a
checkpoint leaves them out.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
from typing import Any

import jax
import numpy as np
from flax import nnx

from redco import layer_stacks
from redco.layer_stacks import layers_of
from redco.protocols import UsageError
from redco.relayout import per_layer
from redco.sharding import named_leaves
from redco_safetensors import torch_name
from redco_zoo_models import quantize as q
from redco_zoo_models import quantized_experts
from redco_zoo_models.checkpoint_files import read_safetensors  # noqa: F401 - public here too
from redco_zoo_models.families import FAMILIES, NOT_YET
from redco_zoo_models.family_config import TEXT_PARTS
from redco_zoo_models.quantized_linear import QuantizedLinear, quantize_linears

# buffers transformers once saved: RoPE's frequencies, GPT-2's causal mask (not c_attn.bias)
HARMLESS_TENSORS = re.compile(r"(rotary_emb\.inv_freq|(^|\.)attn\.(masked_)?bias)$")

DECODER = "redco_zoo_models.decoder:DecoderLM"
MODEL_CLASSES = {  # config.json's model_type -> the zoo class that reads it
    **{family: DECODER for family in (*FAMILIES, *TEXT_PARTS)},
    "gpt2": "redco_zoo_models.gpt2:GPT2LMHeadModel",
    "llava": "redco_zoo_models.llava:LlavaForConditionalGeneration",
    "llava_onevision": "redco_zoo_models.onevision:LlavaOnevisionForConditionalGeneration",
    "idefics3": "redco_zoo_models.idefics3:Idefics3ForConditionalGeneration",
    "smolvlm": "redco_zoo_models.idefics3:Idefics3ForConditionalGeneration",
    "gemma3": "redco_zoo_models.gemma3_vision:Gemma3ForConditionalGeneration",
    "qwen2_5_vl": "redco_zoo_models.qwen_vl:QwenVLForConditionalGeneration",
    "qwen3_vl": "redco_zoo_models.qwen_vl:Qwen3VLForConditionalGeneration",
    "t5": "redco_zoo_models.t5:T5ForConditionalGeneration",
    "vision-encoder-decoder": "redco_zoo_models.vision_encoder_decoder:VisionEncoderDecoderModel",
}
IMAGE_TEXT_CLASSES = {  # a multimodal model_type read as its language model unless images=True
    "qwen3_5": "redco_zoo_models.qwen_vl:Qwen3_5VLForConditionalGeneration",
    "qwen3_5_moe": "redco_zoo_models.qwen_vl:Qwen3_5MoeVLForConditionalGeneration",
    "gemma4": "redco_zoo_models.gemma4_vision:Gemma4ForConditionalGeneration",
    "llama4": "redco_zoo_models.llama4_vision:Llama4ForConditionalGeneration",
}


def auto_class(model_dir: str, images: bool = False) -> type[nnx.Module]:
    """The zoo class for ``model_dir``'s ``config.json`` (by its ``model_type``; ``images``:
    as ``class_of``)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        return class_of(json.load(f), model_dir, images)


def class_of(config: dict, where: str, images: bool = False) -> type[nnx.Module]:
    """The zoo class for a ``config.json``'s contents (by its ``model_type``), found in
    ``where`` (named in the error). A Qwen3.5, Gemma 4 or Llama 4 checkpoint with a vision
    tower is read as its language model (a decoder: text runs, scanned layers, quantised
    bases), or with ``images`` as the image + text model (``IMAGE_TEXT_CLASSES``)."""
    model_type = config.get("model_type")
    if images and model_type in IMAGE_TEXT_CLASSES and "vision_config" in config:
        module, name = IMAGE_TEXT_CLASSES[model_type].split(":")
        return getattr(importlib.import_module(module), name)
    if model_type in NOT_YET:
        raise UsageError(f"{where} holds a {model_type!r} model, which the zoo does not read "
                         f"yet: it needs {NOT_YET[model_type]}.")
    if model_type not in MODEL_CLASSES:
        raise UsageError(f"{where} holds a {model_type!r} model; the zoo reads "
                         f"{sorted(MODEL_CLASSES)}. Convert it to one of those, or add the "
                         "family to redco_zoo_models/families.py.")
    module, name = MODEL_CLASSES[model_type].split(":")
    return getattr(importlib.import_module(module), name)


def from_pretrained(model_class: type[nnx.Module], model_dir: str, dtype: Any = None,
                    seed: int = 0, quantize: str | None = None,
                    **config_changes) -> nnx.Module:
    """``model_class`` built from ``model_dir``'s ``config.json`` with its safetensors weights
    (in ``dtype`` when given), with ``config_changes`` to its config (``scan_layers=True``:
    the decoder's layers stacked, ``redco_zoo_models.layer_scan``). ``quantize`` (``nf4``,
    ``int8``, ``fp8``): the attention and MLP projections held quantised and frozen
    (``redco_zoo_models.quantized_linear``), and a MoE model's experts
    (``redco_zoo_models.quantized_experts``), each quantised as it is read from the file. Raises
    naming the first parameter missing or of another shape, and the checkpoint's tensors the
    model has no place for."""
    cfg = with_changes(_read_config(model_class, model_dir), config_changes)
    model = nnx.eval_shape(lambda: model_class(cfg, rngs=nnx.Rngs(seed)))
    quantized = _quantize_projections(model, quantize)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tensors = read_safetensors(model_dir)  # (lazy: each tensor read where it is used)
    if hasattr(model, "hf_tensors_in"):
        tensors = model.hf_tensors_in(tensors)
    named = dict(named_leaves(params))
    expert_parts = quantized_experts.weight_parts(model)  # {part: (its weight, (E, in, out))}
    arrays, used = {}, set()
    for path, shape in _tensor_shapes(named, quantized, expert_parts).items():
        name, array = _checkpoint_tensor(model_class, model_dir, tensors, path, shape)
        used.add(name)
        arrays.update(_as_params(path, array, quantized, expert_parts, dtype, quantize))
    _check_all_used(model_class, model_dir, tensors, used)
    arrays = layer_stacks.stack(arrays, [p for p in named if layers_of(p)], np.stack)
    leaves = [np.array(arrays[path], leaf.dtype if path.rpartition("/")[0] in quantized
                       or path in expert_parts else dtype or leaf.dtype)
              for path, leaf in named.items()]  # (copies)
    return nnx.merge(graphdef, jax.tree.unflatten(jax.tree.structure(params), leaves), rest)


def _read_config(model_class: type, model_dir: str):
    """``model_class``'s config from ``model_dir``'s ``config.json``; its errors name the file."""
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    try:
        return model_class.config_class.from_hf(config)
    except ValueError as e:
        raise type(e)(f"{model_dir}/{e}" if str(e).startswith("config.json") else
                      f"{model_dir}/config.json: {e}") from None


def _quantize_projections(model: nnx.Module, quantize: str | None) -> dict[str, tuple]:
    """``quantize_linears`` on ``model`` (in place; nothing without ``quantize``):
    ``{module: (in, out)}`` of the projections swapped, a stack's also under its layers' names."""
    quantized = quantize_linears(model, quantize) if quantize else {}
    quantized.update({name: shape for module, shape in list(quantized.items())  # (a stack's
                      if layers_of(module) for name in layer_stacks.layer_names(module)})  # layers)
    return quantized


def _tensor_shapes(named: dict, quantized: dict, expert_parts: dict) -> dict[str, tuple]:
    """``{path: shape}`` of the params read from a checkpoint tensor of that shape, a stacked
    param's layers one by one; a quantised kernel's or expert weight's scales are made with its
    codes (``_as_params``), not read."""
    shapes = {}
    for path, shape in per_layer({p: leaf.shape for p, leaf in named.items()}).items():
        module, _, leaf = path.rpartition("/")
        weight, shape = expert_parts.get(path, (path, shape))
        if not (module in quantized and leaf != "kernel" or weight != path):
            shapes[path] = quantized.get(module, shape)
    return shapes


def _as_params(path: str, array, quantized: dict, expert_parts: dict, dtype: Any,
               quantize: str | None) -> dict:
    """``{path: array}`` of the params the checkpoint tensor for ``path`` becomes: a quantised
    projection's codes and scales, a MoE weight's parts, or the tensor itself (still lazy)."""
    module = path.rpartition("/")[0]
    if module in quantized:
        parts = q.quantize(np.asarray(array, dtype or np.float32), quantize)
        return {f"{module}/{QuantizedLinear.param_name(k)}": np.asarray(v)
                for k, v in parts.items()}
    if path in expert_parts:
        return quantized_experts.parts_of(path, np.asarray(array, dtype or np.float32), quantize)
    return {path: array}


def with_changes(cfg, changes: dict):
    """``cfg`` with ``changes``; an image-text model's ``scan_layers`` is its language model's
    (``cfg.text``, which stacks the tower's blocks too: ``ImageTextModel.stack_tower``)."""
    if "scan_layers" in changes and not hasattr(cfg, "scan_layers") and hasattr(cfg, "text"):
        changes = dict(changes)
        cfg = dataclasses.replace(cfg, text=dataclasses.replace(
            cfg.text, scan_layers=changes.pop("scan_layers")))
    return dataclasses.replace(cfg, **changes) if changes else cfg


def _checkpoint_tensor(model_class: type, model_dir: str, tensors: dict, path: str,
                       shape: tuple) -> tuple[str, np.ndarray]:
    """``(name, tensor)``: the checkpoint's tensor for the param at ``path``, in the zoo's
    layout (a lazy view), or an error naming what is missing or of another shape."""
    tied = getattr(model_class, "hf_tied_weights", {})
    base = getattr(model_class, "base_model_prefix", None)  # e.g. GPT-2's "transformer"
    name, perm = torch_name(path, len(shape))
    if name not in tensors and base and name.removeprefix(f"{base}.") in tensors:
        name = name.removeprefix(f"{base}.")  # a checkpoint of the bare base model
    if name not in tensors and tied.get(name) in tensors:
        name = tied[name]  # a tied copy transformers left out
    if name not in tensors:
        raise KeyError(f"{model_dir} has no tensor {name} (for {path}); is it a "
                       f"{model_class.__name__} checkpoint of this config.json?")
    array = tensors[name] if perm is None else tensors[name].transpose(np.argsort(perm))
    if array.shape != tuple(shape):
        raise ValueError(f"{name} in {model_dir} has shape {array.shape}; "
                         f"{model_class.__name__} expects {tuple(shape)} (for {path}).")
    return name, array


def _check_all_used(model_class: type, model_dir: str, tensors: dict, used: set) -> None:
    """Refuse a checkpoint with tensors the model has no place for (a config that does not
    match the weights)."""
    tied = getattr(model_class, "hf_tied_weights", {})
    left = sorted(n for n in set(tensors) - used - set(tied.values())
                  if not HARMLESS_TENSORS.search(n))
    if left:
        raise ValueError(f"{model_dir}: {len(left)} tensors have no place in "
                         f"{model_class.__name__} as its config.json describes it, e.g. "
                         f"{left[:3]}: a config that does not match the weights, or a variant "
                         "the zoo does not implement.")


GENERATION_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


def save_generation_config(config: dict, model_dir: str) -> None:
    """``generation_config.json`` with the config's token ids, as transformers writes it: without
    it ``generate()`` there falls back to its own defaults and runs past the end-of-turn token."""
    ids = {k: config[k] for k in GENERATION_KEYS if config.get(k) is not None}
    if ids:
        with open(os.path.join(model_dir, "generation_config.json"), "w") as f:
            json.dump({**ids, "_from_model_config": True}, f, indent=2)


def save_pretrained(model: nnx.Module, model_dir: str) -> None:
    """Write ``config.json`` and ``model.safetensors`` (PyTorch names) for ``model``; a model
    with LoRA adapters (``redco_zoo_models.lora``) or a quantised base is saved merged (the
    model is left as is)."""
    from safetensors.numpy import save_file

    from redco_zoo_models.lora import merge_lora, mergeable_layers
    if mergeable_layers(model):
        model = merge_lora(nnx.clone(model))
    os.makedirs(model_dir, exist_ok=True)
    tensors = {}
    named = layer_stacks.unstack({p: np.asarray(x) for p, x in
                                  named_leaves(nnx.state(model, nnx.Param))})
    for path, leaf in named.items():  # stacked layers (redco.layer_stacks) one by one
        name, perm = torch_name(path, np.ndim(leaf))
        array = np.asarray(leaf)
        tensors[name] = array if perm is None else array.transpose(perm)
    if hasattr(model, "hf_tensors_out"):
        tensors = model.hf_tensors_out(tensors)
    tensors = {name: np.ascontiguousarray(t).reshape(np.shape(t))  # (a 0-d one stays 0-d)
               for name, t in tensors.items()}
    save_file(tensors, os.path.join(model_dir, "model.safetensors"), metadata={"format": "pt"})
    config = model.cfg.to_hf()
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_generation_config(config, model_dir)
