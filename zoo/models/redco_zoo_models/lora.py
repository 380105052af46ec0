"""LoRA inside the zoo's models: each selected ``nnx.Linear`` becomes a ``LoRALinear`` that
computes ``x @ W + ((x @ A) @ B) * alpha / r`` with a backward pass of its own: it keeps only
``x`` of the activations, makes no gradient for the frozen kernel, and where a step has more
tokens than the kernel has rows it multiplies by ``W + A @ B``, made afresh in the forward and
the backward pass, rather than summing two full-size products (XLA fuses such a sum into its
users and keeps both products instead). Its params keep the names of ``redco.lora``
(``q_proj/kernel``, ``q_proj/lora_a``, ``q_proj/lora_b``): ``redco.lora.trainable_mask``, the
sharding rules and checkpoints treat both the same.

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

from redco import lora as core_lora
from redco import remat
from redco_safetensors import torch_name

DEFAULT_TARGETS = core_lora.DEFAULT_TARGETS


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _adapted(x, kernel, a, b, precision):
    """``x @ W + (x @ A) @ B`` (``B`` already scaled). Differentiated, its backward pass keeps
    only ``x`` (and the params) and forms ``W``'s gradient only if it is used; where there are
    more tokens than the kernel has rows, it multiplies by ``W + A @ B`` (one full-size
    product, not two whose sum XLA may never store, keeping both instead)."""
    dot = functools.partial(jnp.dot, precision=precision)
    return dot(x, kernel) + dot(dot(x, a), b).astype(x.dtype)


def _merge_pays(tokens: jax.Array, kernel: jax.Array) -> bool:
    """Whether ``W + A @ B`` [in, out] is smaller than a product [tokens, out] it saves."""
    return tokens.size // tokens.shape[-1] >= kernel.shape[0]


def _merged(kernel, a, b, tie, precision):
    """``W + A @ B``; given a ``tie``, made from its first element too (times zero), so that XLA
    cannot share one merged kernel between two passes (the forward pass and the backward pass,
    or its recomputation), keeping a second copy of the adapted kernels alive all step long.
    Where ``tie`` is sharded, that element costs a scalar all-reduce."""
    if tie is not None:
        b = b + (tie[(0,) * tie.ndim] * 0).astype(b.dtype)
    return kernel + jnp.dot(a, b, precision=precision).astype(kernel.dtype)


def _adapted_fwd(x, kernel, a, b, precision):
    if not _merge_pays(x, kernel):
        return _adapted(x, kernel, a, b, precision), (x, kernel, a, b)
    tie = x if remat.current() == "full" else None  # "full" runs this again in the backward
    y = jnp.dot(x, _merged(kernel, a, b, tie, precision), precision=precision)
    return y, (x, kernel, a, b)


def _adapted_bwd(precision, saved, dy):
    x, kernel, a, b = saved
    rows = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731 - [..., n] -> [tokens, n]
    dot = functools.partial(jnp.dot, precision=precision)
    d_x_a = dot(dy, b.T)
    d_x = (dot(dy, _merged(kernel, a, b, dy, precision).T) if _merge_pays(dy, kernel.T)
           else dot(dy, kernel.T) + dot(d_x_a, a.T))
    d_a = dot(rows(x).T, rows(d_x_a))
    d_b = dot(rows(dot(x, a)).T, rows(dy))
    d_kernel = dot(rows(x).T, rows(dy))  # dead code (dropped by XLA) when the base is frozen
    return (d_x.astype(x.dtype), d_kernel.astype(kernel.dtype), d_a.astype(a.dtype),
            d_b.astype(b.dtype))


_adapted.defvjp(_adapted_fwd, _adapted_bwd)


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
        """``x @ W + ((x @ A) @ B) * scale`` (+ bias), with ``B * scale`` (rank r) rather than
        the full-size product scaled. The backward pass keeps ``x`` and, under a policy that
        keeps matmul outputs, the output (``redco.remat.matmul_output``): never two full-size
        products, and no gradient for a frozen ``W``."""
        x, kernel, a, b = self.promote_dtype(
            (x, self.kernel[...], self.lora_a[...], self.lora_b[...]), dtype=self.dtype)
        y = remat.matmul_output(_adapted(x, kernel, a, b * self.scale, self.precision))
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


TASK_TYPES = {"DecoderLM": "CAUSAL_LM", "GPT2LMHeadModel": "CAUSAL_LM",
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
