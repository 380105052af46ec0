"""A frozen, quantised ``nnx.Linear`` (QLoRA's base): its kernel held as ``redco_zoo_models.
quantize``'s parts and dequantised inside the step, in the matmul's dtype, for each call.

The parts are params named after the kernel: the codes are ``kernel`` itself (so LoRA targets,
sharding rules and checkpoint names read the path as before), the scales ``kernel_<part>``
(``kernel_absmax``, ``kernel_absmax_scale``, ``kernel_absmax_offset`` for NF4; ``kernel_scale``
for int8 and fp8). They never train: a quantised base is only trained through LoRA adapters
(``redco_zoo_models.lora.add_lora`` gives this layer ``lora_a`` and ``lora_b``, in the dtype
the model was loaded in), which the layer adds as ``LoRALinear`` does. ``merged()`` is a plain
``nnx.Linear`` of the dequantised kernel plus the adapters: what an export writes.

A scanned decoder's stacked projection (``redco_zoo_models.layer_scan``: kernel [L, in, out]) is
one ``QuantizedLinear`` whose parts and adapters carry the layer axis in front, each layer
quantised alone (``quantize``'s stacks); the scan's body slices them with the other params, so
each call sees one layer's parts, as an unrolled layer's.

Sharding: the step's dataflow (``redco.dataflow``) does not see through the dequantisation, so
``sharding_rules`` gives each part its kernel's spec from the deployer's rules by name (``W``
[in, out] split ``(a, b)``: the codes and the absmax codes and scales ``(a, b)``, a per-channel
scale ``(b,)``, the offset whole), as rules checked before the rule set's: the codes and their
scales split together along the same mesh axis (a stack's parts: the same, the layer axis whole).

``quantize_linears(model, fmt)`` swaps a model's attention and MLP projections for these (on a
real model or on ``nnx.eval_shape``'s abstract one, whose parts ``hf.from_pretrained`` then
fills tensor by tensor as it reads them), and a MoE model's experts for
``quantized_experts.QuantizedExperts``. Embeddings, norms and the output head stay as they are.
"""
from __future__ import annotations

import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn.dtypes import promote_dtype
from jax.sharding import PartitionSpec as P

from redco import lora as core_lora
from redco.layer_stacks import layers_of
from redco.sharding import spec_for
from redco_zoo_models import quantize as q
from redco_zoo_models import quantized_experts
from redco_zoo_models.lora_matmul import adapted_quantized_matmul
from redco_zoo_models.nnx_utils import modules_of_type, replace_module

TARGETS = core_lora.DEFAULT_TARGETS  # attention and MLP projections


class QuantizedLinear(nnx.Module):
    """``nnx.Linear`` with a frozen ``fmt`` kernel (module docstring)."""

    def __init__(self, linear: nnx.Linear, fmt: str):
        kernel = linear.kernel.get_value()
        self.fmt, self.in_features, self.out_features = fmt, linear.in_features, linear.out_features
        self.dtype, self.param_dtype, self.precision = (linear.dtype, linear.param_dtype,
                                                        linear.precision)
        parts = q.quantize(kernel, fmt)
        self.part_names = tuple(parts)
        for name, value in parts.items():
            setattr(self, self.param_name(name), nnx.Param(value))
        self.bias = nnx.Param(linear.bias.get_value()) if linear.bias is not None else None
        self.lora_a, self.lora_b = nnx.data(None), nnx.data(None)  # (add_adapters sets them)
        self.scale = 0.0

    @staticmethod
    def param_name(part: str) -> str:
        """The param holding a part: ``kernel`` for the codes, else ``kernel_<part>``."""
        return "kernel" if part == "codes" else f"kernel_{part}"

    def parts(self) -> q.Parts:
        return {name: getattr(self, self.param_name(name))[...] for name in self.part_names}

    def add_adapters(self, rank: int, alpha: float, key: jax.Array) -> None:
        """LoRA's ``A`` [in, r] and ``B`` [r, out] (zeros), in the param dtype; a stack's
        [L, in, r] and [L, r, out] (``key``: one per layer, ``redco.lora.adapter_keys``)."""
        shape = (self.in_features, self.out_features)
        core_lora.check_rank(f"{self.fmt} kernel", shape, rank)
        layers = self.kernel.get_value().shape[:-2]  # (L,) for a stack of layers, else ()
        a, b = core_lora.init_adapters(key, (*layers, *shape), rank, self.param_dtype)
        self.lora_a, self.lora_b = nnx.Param(a), nnx.Param(b)
        self.scale = alpha / rank

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.lora_a is None:
            (x,) = promote_dtype((x,), dtype=self.dtype)
            y = jnp.dot(x, q.dequantize(self.parts(), self.fmt, x.dtype),
                        precision=self.precision)
        else:
            x, a, b = promote_dtype((x, self.lora_a[...], self.lora_b[...]), dtype=self.dtype)
            dequantize = functools.partial(q.dequantize, fmt=self.fmt, dtype=x.dtype)
            y = adapted_quantized_matmul(x, self.parts(), dequantize, a, b * self.scale,
                                         self.precision)
        return y if self.bias is None else y + self.bias[...].astype(y.dtype)

    def merged(self) -> nnx.Linear:
        """A plain ``nnx.Linear``: the dequantised kernel (param dtype) plus ``scale * A @ B``."""
        kernel = q.dequantize(self.parts(), self.fmt, self.param_dtype)
        if self.lora_a is not None:
            kernel = kernel + (self.scale * (self.lora_a[...] @ self.lora_b[...])).astype(
                kernel.dtype)
        bias = self.bias[...] if self.bias is not None else None
        return nnx.Linear(self.in_features, self.out_features, use_bias=bias is not None,
                          dtype=self.dtype, param_dtype=self.param_dtype,
                          precision=self.precision, kernel_init=lambda *_: kernel,
                          bias_init=lambda *_: bias, rngs=nnx.Rngs(0))


def quantize_linears(model: nnx.Module, fmt: str, targets: str = TARGETS) -> dict[str, Any]:
    """Swap (in place) every ``nnx.Linear`` whose kernel path ``targets`` selects for a
    ``QuantizedLinear`` of ``fmt``, and every MoE block's experts for
    ``quantized_experts.QuantizedExperts``; returns ``{module path: (in, out)}`` of the linears."""
    q.check_format(fmt)
    chosen = set(core_lora.kernel_paths(nnx.state(model, nnx.Param), targets))
    swapped = {}
    for path, linear in modules_of_type(model, nnx.Linear):
        name = "/".join(map(str, path))
        if f"{name}/kernel" in chosen:
            replace_module(model, path, QuantizedLinear(linear, fmt))
            swapped[name] = (linear.in_features, linear.out_features)
    quantized_experts.quantize_experts(model, fmt)
    return swapped


def quantized_layers(model: nnx.Module) -> list[tuple[str, QuantizedLinear]]:
    """``[(module path, layer)]`` of the model's ``QuantizedLinear`` layers."""
    return [("/".join(map(str, path)), m) for path, m in nnx.iter_modules(model)
            if path and isinstance(m, QuantizedLinear)]


def sharding_rules(model: nnx.Module, deployer, first=()) -> list[tuple[str, P]]:
    """Rules putting every quantised kernel's (and expert weight's) parts where ``first`` (rules
    the caller puts before the deployer's, e.g. expert parallelism's) or else the deployer's
    rules by name put it (module docstring); none without a mesh yet (``n_model_shards="auto"``)."""
    if not (quantized_layers(model) or quantized_experts.quantized_experts(model)) or \
            deployer.mesh is None:
        return []
    by_name = list(first) + list(deployer.get_sharding_rules(nnx.state(model, nnx.Param)))
    return part_rules(model, by_name) + quantized_experts.part_rules(model, by_name, deployer.mesh)


def part_rules(model: nnx.Module, by_name: list[tuple[str, P]]) -> list[tuple[str, P]]:
    """Rules giving each part of every ``QuantizedLinear`` of ``model`` (real or abstract, from
    ``nnx.eval_shape``) its kernel's spec in the rules by name ``by_name`` (``quantize.part_spec``); a
    stack's parts one layer's spec (``redco.sharding`` puts the layer axis in front, whole)."""
    rules = []
    for path, layer in quantized_layers(model):
        stacked = layers_of(path) is not None
        spec = spec_for(f"{path}/kernel", by_name)
        for name in layer.part_names:
            value = getattr(layer, layer.param_name(name)).get_value()
            rules.append((f"^{re.escape(path)}/{layer.param_name(name)}$",
                          q.part_spec(spec, value.ndim - stacked)))
    return rules
