"""LoRA inside the zoo's models: each selected ``nnx.Linear`` becomes a ``LoRALinear`` that
computes ``x @ W + ((x @ A) @ B) * alpha / r``, so no full-size merged kernel, and no full-size
kernel gradient, is ever made. Its params keep the names of ``redco.lora`` (``q_proj/kernel``,
``q_proj/lora_a``, ``q_proj/lora_b``): ``redco.lora.trainable_mask``, the sharding rules and
checkpoints treat both the same.

    add_lora(model, rank=8)                  # in place; split_model(model) then has adapters
    save_pretrained(model, "out")            # merged: a plain HuggingFace model directory
    save_peft_adapters(model, "adapter")     # unmerged: PEFT's adapter_model.safetensors
"""
from __future__ import annotations

import functools
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from redco import lora as core_lora
from redco import remat
from redco_safetensors import torch_name

DEFAULT_TARGETS = core_lora.DEFAULT_TARGETS
_X_A = "redco_lora_x_a"
_KEEP_X_A = jax.checkpoint_policies.save_only_these_names(_X_A)


def _adapted(x, kernel, a, b, scale: float, precision) -> jax.Array:
    """``x @ W + ((x @ A) @ B) * scale``, with ``x @ A`` named for ``_KEEP_X_A``."""
    x_a = checkpoint_name(jnp.dot(x, a, precision=precision), _X_A)
    low = jnp.dot(x_a, b * scale, precision=precision)  # scaled B: no full-size product to scale
    return jnp.dot(x, kernel, precision=precision) + low.astype(x.dtype)


class LoRALinear(nnx.Linear):
    """``nnx.Linear`` plus adapters ``lora_a`` [in, r] and ``lora_b`` [r, out] (zeros)."""

    def __init__(self, linear: nnx.Linear, rank: int, alpha: float, key: jax.Array):
        kernel = linear.kernel[...]
        bias = linear.bias[...] if linear.bias is not None else None
        super().__init__(linear.in_features, linear.out_features, use_bias=bias is not None,
                         dtype=linear.dtype, param_dtype=linear.param_dtype,
                         precision=linear.precision, kernel_init=lambda *_: kernel,
                         bias_init=lambda *_: bias, rngs=nnx.Rngs(0))
        a, b = core_lora.init_adapters(key, kernel.shape, rank, kernel.dtype)
        self.lora_a, self.lora_b = nnx.Param(a), nnx.Param(b)
        self.scale = alpha / rank

    def __call__(self, x):
        """``x @ W + ((x @ A) @ B) * scale`` (+ bias). What the backward pass may keep of it is
        the sum, as a matmul output (``redco.remat.matmul_output``), and ``x @ A`` [..., r]:
        never the two full-size products both, under any remat policy."""
        x, kernel, a, b = self.promote_dtype(
            (x, self.kernel[...], self.lora_a[...], self.lora_b[...]), dtype=self.dtype)
        adapted = functools.partial(_adapted, scale=self.scale, precision=self.precision)
        y = remat.matmul_output(jax.checkpoint(adapted, policy=_KEEP_X_A)(x, kernel, a, b))
        if self.bias is not None:
            y = y + self.bias[...].astype(y.dtype)
        return y

    def merged(self) -> nnx.Linear:
        """A plain ``nnx.Linear`` with ``W + scale * A @ B``."""
        kernel = self.kernel[...] + (self.scale * (self.lora_a[...] @ self.lora_b[...])).astype(
            self.kernel[...].dtype)
        bias = self.bias[...] if self.bias is not None else None
        return nnx.Linear(self.in_features, self.out_features, use_bias=bias is not None,
                          dtype=self.dtype, param_dtype=self.param_dtype, precision=self.precision,
                          kernel_init=lambda *_: kernel, bias_init=lambda *_: bias,
                          rngs=nnx.Rngs(0))


def _linears(model: nnx.Module, kind: type) -> list[tuple[tuple, nnx.Module]]:
    return [(path, m) for path, m in nnx.iter_modules(model) if type(m) is kind and path]


def _replace(model: nnx.Module, path: tuple, new: nnx.Module) -> None:
    parent = model
    for key in path[:-1]:
        parent = parent[key] if isinstance(key, int) else getattr(parent, key)
    if isinstance(path[-1], int):
        parent[path[-1]] = new
    else:
        setattr(parent, path[-1], new)


def add_lora(model: nnx.Module, rank: int = 8, alpha: float = 16.0,
             targets: str = DEFAULT_TARGETS, seed: int = 0) -> nnx.Module:
    """Give ``model`` (in place; also returned) adapters on every ``nnx.Linear`` whose kernel
    path ``targets`` selects (default: attention and MLP projections). Train with
    ``Trainer(..., trainable=redco.lora.trainable_mask(params))``."""
    params = nnx.state(model, nnx.Param)
    chosen = set(core_lora.select(params, targets, rank))
    found = [(path, m) for path, m in _linears(model, nnx.Linear)
             if "/".join(map(str, path)) + "/kernel" in chosen]
    missed = chosen - {"/".join(map(str, p)) + "/kernel" for p, _ in found}
    if missed:
        raise ValueError(f"LoRA targets {targets!r} select kernels that are not nnx.Linear "
                         f"layers: {sorted(missed)[:4]}; narrow the regex, or use "
                         "redco.lora.add_lora on the params for any kernel.")
    keys = jax.random.split(jax.random.PRNGKey(seed), max(len(found), 1))
    for (path, linear), key in zip(found, keys):
        _replace(model, path, LoRALinear(linear, rank, alpha, key))
    return model


def lora_layers(model: nnx.Module) -> list[tuple[str, LoRALinear]]:
    """``[(module path, layer), ...]`` of the model's ``LoRALinear`` layers."""
    return [("/".join(map(str, path)), m) for path, m in _linears(model, LoRALinear)]


def merge_lora(model: nnx.Module) -> nnx.Module:
    """``model`` (in place; also returned) with every ``LoRALinear`` merged into a plain
    ``nnx.Linear``: the base model's structure, for export."""
    for path, layer in [(p, m) for p, m in _linears(model, LoRALinear)]:
        _replace(model, path, layer.merged())
    return model


def has_lora(model: nnx.Module) -> bool:
    return bool(lora_layers(model))


TASK_TYPES = {"LlamaForCausalLM": "CAUSAL_LM", "GPT2LMHeadModel": "CAUSAL_LM",
              "T5ForConditionalGeneration": "SEQ_2_SEQ_LM"}


def peft_tensors(model: nnx.Module) -> dict[str, np.ndarray]:
    """The adapters under PEFT's names: ``base_model.model.<module>.lora_A.weight`` [r, in]
    and ``lora_B.weight`` [out, r] (PyTorch's layout: transposed)."""
    tensors = {}
    for path, layer in lora_layers(model):
        module = torch_name(f"{path}/kernel", 2)[0].removesuffix(".weight")
        tensors[f"base_model.model.{module}.lora_A.weight"] = np.ascontiguousarray(
            np.asarray(layer.lora_a[...]).T)
        tensors[f"base_model.model.{module}.lora_B.weight"] = np.ascontiguousarray(
            np.asarray(layer.lora_b[...]).T)
    return tensors


def save_peft_adapters(model: nnx.Module, adapter_dir: str,
                       base_model_name_or_path: str | None = None) -> str:
    """Write the unmerged adapters as PEFT does: ``adapter_model.safetensors`` and
    ``adapter_config.json`` (``peft.PeftModel.from_pretrained(base, adapter_dir)`` reads
    them). Returns ``adapter_dir``."""
    from safetensors.numpy import save_file
    layers = lora_layers(model)
    if not layers:
        raise ValueError("The model has no LoRA adapters to save: call add_lora(model) first "
                         "(or save_pretrained for the whole model).")
    ranks = {int(layer.lora_a.shape[1]) for _, layer in layers}
    scales = {layer.scale * layer.lora_a.shape[1] for _, layer in layers}
    if len(ranks) != 1 or len(scales) != 1:
        raise ValueError(f"PEFT's layout has one rank and alpha; the adapters have ranks "
                         f"{sorted(ranks)} and alphas {sorted(scales)}.")
    os.makedirs(adapter_dir, exist_ok=True)
    save_file(peft_tensors(model), os.path.join(adapter_dir, "adapter_model.safetensors"),
              metadata={"format": "pt"})
    targets = sorted({re.split(r"[/.]", path)[-1] for path, _ in layers})
    config = {"peft_type": "LORA", "task_type": TASK_TYPES.get(type(model).__name__),
              "base_model_name_or_path": base_model_name_or_path, "r": ranks.pop(),
              "lora_alpha": scales.pop(), "lora_dropout": 0.0, "bias": "none",
              "target_modules": targets, "fan_in_fan_out": False, "use_rslora": False,
              "modules_to_save": None, "inference_mode": True, "init_lora_weights": True}
    with open(os.path.join(adapter_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return adapter_dir
