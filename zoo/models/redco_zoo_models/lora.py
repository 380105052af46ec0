"""LoRA inside the zoo's models: each selected ``nnx.Linear`` becomes a ``LoRALinear`` that
computes ``x @ W + ((x @ A) @ B) * alpha / r`` with a backward pass of its own
(``redco_zoo_models.lora_matmul``): it keeps only
``x`` of the activations, makes no gradient for the frozen kernel, and where a step has more
tokens than the kernel has rows it multiplies by ``W + A @ B``, made afresh in the forward and
the backward pass, rather than summing two full-size products (XLA fuses such a sum into its
users and keeps both products instead). Its params keep the names of ``redco.lora``
(``q_proj/kernel``, ``q_proj/lora_a``, ``q_proj/lora_b``): ``redco.lora.trainable_mask``, the
sharding rules and checkpoints treat both the same. A frozen quantised projection
(``redco_zoo_models.quantized_linear``, QLoRA) gets its adapters in place instead.

A scanned decoder's stacked projection (``redco_zoo_models.layer_scan``: one ``nnx.Linear``
holding L layers' kernels) becomes one ``LoRALinear`` with stacked adapters, ``A`` [L, in, r]
and ``B`` [L, r, out], drawn per layer as the unrolled model's (``redco.lora.adapter_keys``):
the scan slices them with the kernel, a merged export merges each layer, and PEFT's adapters
are written per layer.

    add_lora(model, rank=8)                  # in place; split_model(model) then has adapters
    save_pretrained(model, "out")            # merged: a plain HuggingFace model directory
    save_peft_adapters(model, "adapter")     # unmerged: PEFT's adapter_model.safetensors
    load_peft_adapters(model, "adapter")     # those adapters on a freshly loaded base
                                             # (quantised or not: redco serve --adapter)
"""
from __future__ import annotations

import json
import os
import re

import jax
import numpy as np
from flax import nnx

from redco import lora as core_lora
from redco.layer_stacks import layer_names, layers_of, unstack
from redco_safetensors import torch_name
from redco_zoo_models.lora_matmul import adapted_matmul
from redco_zoo_models.nnx_utils import replace_module
from redco_zoo_models.quantized_experts import QuantizedExperts
from redco_zoo_models.quantized_linear import QuantizedLinear

DEFAULT_TARGETS = core_lora.DEFAULT_TARGETS


class LoRALinear(nnx.Linear):
    """``nnx.Linear`` plus adapters ``lora_a`` [in, r] and ``lora_b`` [r, out] (zeros); of a
    stacked ``linear`` (kernel [L, in, out], ``key`` one per layer), [L, in, r] and [L, r, out]."""

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
        y = adapted_matmul(x, kernel, a, b * self.scale, self.precision)
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


def add_lora(model: nnx.Module, rank: int = 8, alpha: float = 16.0,
             targets: str = DEFAULT_TARGETS, seed: int = 0) -> nnx.Module:
    """Give ``model`` (in place; also returned) adapters on every ``nnx.Linear`` (or frozen
    ``QuantizedLinear``, QLoRA) whose kernel path ``targets`` selects (default: attention and
    MLP projections). Train with ``Trainer(..., trainable=redco.lora.trainable_mask(params))``."""
    params = nnx.state(model, nnx.Param)
    chosen = set(core_lora.select(params, targets, rank))
    found = [(path, m) for path, m in nnx.iter_modules(model)
             if type(m) in (nnx.Linear, QuantizedLinear) and path
             and "/".join(map(str, path)) + "/kernel" in chosen]
    missed = chosen - {"/".join(map(str, p)) + "/kernel" for p, _ in found}
    if missed:
        raise ValueError(f"LoRA targets {targets!r} select kernels that are not nnx.Linear "
                         f"layers: {sorted(missed)[:4]}; narrow the regex, or use "
                         "redco.lora.add_lora on the params for any kernel.")
    keys = core_lora.adapter_keys(["/".join(map(str, p)) + "/kernel" for p, _ in found], seed)
    for path, linear in found:
        key = keys["/".join(map(str, path)) + "/kernel"]
        if isinstance(linear, QuantizedLinear):
            linear.add_adapters(rank, alpha, key)
        else:
            replace_module(model, path, LoRALinear(linear, rank, alpha, key))
    return model


def mergeable_layers(model: nnx.Module) -> list[tuple[tuple, nnx.Module]]:
    """``[(path, layer)]`` of the layers an export merges: ``LoRALinear`` and
    ``QuantizedLinear`` (dequantised, with or without adapters), and ``QuantizedExperts``
    (dequantised)."""
    return [(path, m) for path, m in nnx.iter_modules(model)
            if path and type(m) in (LoRALinear, QuantizedLinear, QuantizedExperts)]


def lora_layers(model: nnx.Module) -> list[tuple[str, nnx.Module]]:
    """``[(module path, layer), ...]`` of the model's layers with adapters."""
    return [("/".join(map(str, path)), m) for path, m in mergeable_layers(model)
            if getattr(m, "lora_a", None) is not None]


def merge_lora(model: nnx.Module) -> nnx.Module:
    """``model`` (in place; also returned) with every ``LoRALinear`` and ``QuantizedLinear``
    merged into a plain ``nnx.Linear`` (and ``QuantizedExperts`` into plain ``moe.Experts``):
    the base model's structure, for export."""
    for path, layer in mergeable_layers(model):
        replace_module(model, path, layer.merged())
    return model


def has_lora(model: nnx.Module) -> bool:
    return bool(lora_layers(model))


TASK_TYPES = {"DecoderLM": "CAUSAL_LM", "GPT2LMHeadModel": "CAUSAL_LM",
              "T5ForConditionalGeneration": "SEQ_2_SEQ_LM"}


def peft_tensors(model: nnx.Module) -> dict[str, np.ndarray]:
    """The adapters under PEFT's names: ``base_model.model.<module>.lora_A.weight`` [r, in]
    and ``lora_B.weight`` [out, r] (PyTorch's layout: transposed), a stacked layer's per layer."""
    named = {f"{path}/{name}": np.asarray(getattr(layer, name)[...])
             for path, layer in lora_layers(model) for name in core_lora.SUFFIXES}
    tensors = {}
    for name, adapter in unstack(named).items():
        path, which = name.rsplit("/", 1)
        module = torch_name(f"{path}/kernel", 2)[0].removesuffix(".weight")
        peft = "lora_A" if which == "lora_a" else "lora_B"
        tensors[f"base_model.model.{module}.{peft}.weight"] = np.ascontiguousarray(adapter.T)
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
    ranks = {int(layer.lora_a.shape[-1]) for _, layer in layers}
    scales = {layer.scale * layer.lora_a.shape[-1] for _, layer in layers}
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


PEFT_PREFIX, PEFT_SUFFIXES = "base_model.model.", (".lora_A.weight", ".lora_B.weight")


def load_peft_adapters(model: nnx.Module, adapter_dir: str) -> nnx.Module:
    """Give ``model`` (in place; also returned: its base full-precision or quantised, its layers
    one by one or stacked)
    the adapters ``save_peft_adapters`` (or PEFT) wrote in ``adapter_dir``: rank and alpha from
    ``adapter_config.json``, one adapter pair on each module the file names. Refused, naming
    them, where the file and the model's projections do not match."""
    from safetensors.numpy import load_file
    files = [os.path.join(adapter_dir, n) for n in ("adapter_config.json",
                                                    "adapter_model.safetensors")]
    if not all(map(os.path.isfile, files)):
        raise ValueError(f"{adapter_dir}: not a PEFT adapter directory (adapter_config.json and "
                         "adapter_model.safetensors): give the adapter directory a zoo run "
                         "writes (workdir/adapter).")
    with open(files[0]) as f:
        config = json.load(f)
    tensors = load_file(files[1])
    modules = {name.removeprefix(PEFT_PREFIX).removesuffix(PEFT_SUFFIXES[0])
               for name in tensors if name.endswith(PEFT_SUFFIXES[0])}
    paths = projections_by_torch_name(model)
    if missing := sorted(modules - set(paths)):
        raise ValueError(f"{adapter_dir} holds adapters for {missing[:4]}, which the model has "
                         "no projection of: load the base model the adapters were trained on.")
    targets = "^(" + "|".join(re.escape(paths[m][0]) for m in sorted(modules)) + ")/kernel$"
    add_lora(model, config["r"], config["lora_alpha"], targets)
    layers = dict(lora_layers(model))
    for module in sorted(modules):
        path, layer = paths[module]
        for adapter, suffix in zip(core_lora.SUFFIXES, PEFT_SUFFIXES):
            param, value = (getattr(layers[path], adapter),
                            tensors[PEFT_PREFIX + module + suffix].T)
            whole = param.get_value()
            want = whole.shape if layer is None else whole.shape[1:]
            if value.shape != want:
                raise ValueError(f"{adapter_dir}: {module}{suffix} is {value.T.shape}, not "
                                 f"{want[::-1]} as rank {config['r']} over "
                                 "the model's projection: a different base or rank.")
            value = jax.numpy.asarray(value, whole.dtype)
            param.set_value(value if layer is None else whole.at[layer].set(value))
    return model


def projections_by_torch_name(model: nnx.Module) -> dict[str, tuple[str, int | None]]:
    """``{torch module name: (module path, layer)}`` of the model's projections: a stacked
    one (``model/layers/0:2/...``, ``layer_scan``) once per layer, with its place in the stack;
    ``layer`` None for a projection of its own."""
    out = {}
    for path, m in nnx.iter_modules(model):
        if not path or type(m) not in (nnx.Linear, QuantizedLinear):
            continue
        module = "/".join(map(str, path))
        names = layer_names(f"{module}/kernel") if layers_of(module) else [f"{module}/kernel"]
        for i, name in enumerate(names):
            torch = torch_name(name, 2)[0].removesuffix(".weight")
            out[torch] = (module, i if layers_of(module) else None)
    return out
