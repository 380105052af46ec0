"""Frozen, quantised MoE experts (QLoRA's base, ``--quantize_base``): an ``moe.Experts`` block's
stacked weights held as ``redco_zoo_models.quantize``'s parts, each expert's [in, out] matrix
quantised as ``quantize.quantize`` does a kernel (vmapped over the expert axis: every part keeps
the expert axis first), and dequantised inside the step, in the compute dtype, where the experts
compute: on one device's view, or on each device's own experts inside expert parallelism's
``shard_map`` (``redco_zoo_models.expert_parallel``), which then never holds another device's
experts in full precision.

The codes keep the weight's name (``gate_proj``, ``up_proj``, ``down_proj``), so the sharding
rules by name, the EP rules and checkpoint names read the path as before; the scales are
``<weight>_<part>`` (``gate_proj_absmax``, ``gate_proj_absmax_scale``,
``gate_proj_absmax_offset`` for NF4; ``gate_proj_scale`` for int8 and fp8). gpt-oss's expert
biases stay as they are. Nothing here trains: LoRA does not target experts. ``merged()`` is a
plain ``moe.Experts`` of the dequantised weights: what an export writes.

Sharding (``part_rules``): every part gets its weight's spec from the rules by name, the expert
axis as the weight's (under ``+ep`` over ``dp``: the codes and their scales split together) and
the [in, out] axes as ``quantize.part_spec`` gives a kernel's parts. Given the mesh, a
dim of a part that does not divide by its mesh axes (NF4's few absmax scales per expert) is left
whole, rather than the whole part replicated: the expert axis stays split.

A scanned decoder's stacked experts (``redco_zoo_models.layer_scan``: weights (L, E, in, out))
are one block whose parts carry the layer axis in front of the expert axis, each layer's experts
quantised alone (``quantize``'s stacks: the unrolled model's codes and scales, stacked); the
scan's body slices them with the other params, so each step's block sees one layer's parts, as
an unrolled block's. ``weight_parts`` names a stack's parts per layer too (``hf`` reads each
layer's tensors, quantises them and stacks the parts), and ``part_rules`` gives them one layer's
spec, the layer axis in front whole (``redco.layer_stacks.layer_spec``).

``quantize_experts(model, fmt)`` swaps every ``Experts`` block of a model (real, or
``nnx.eval_shape``'s abstract one, whose parts ``hf.from_pretrained`` fills as it reads them);
``quantized_linear.quantize_linears`` calls it.
"""
from __future__ import annotations

import math
import re

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from redco.layer_stacks import layer_names, layers_of
from redco.sharding import spec_for
from redco_zoo_models import quantize as q
from redco_zoo_models.moe import Experts
from redco_zoo_models.nnx_utils import modules_of_type, replace_module

WEIGHTS = ("gate_proj", "up_proj", "down_proj")


def weight_names(cfg) -> tuple[str, ...]:
    """The experts' weights: ``WEIGHTS``, less ``gate_proj`` for ungated ones (Nemotron-H)."""
    return WEIGHTS if cfg.gated else WEIGHTS[1:]


def param_name(weight: str, part: str) -> str:
    """The param holding a part: the weight's name for the codes, else ``<weight>_<part>``."""
    return weight if part == "codes" else f"{weight}_{part}"


class QuantizedExperts(Experts):
    """``moe.Experts`` with frozen ``fmt`` weights (module docstring)."""

    def __init__(self, experts: Experts, fmt: str):
        self.cfg, self.fmt = experts.cfg, fmt
        weights = {w: getattr(experts, w).get_value() for w in weight_names(self.cfg)}
        self.param_dtype = weights["up_proj"].dtype  # (merged() gives the weights back in it)
        self.weight_shapes = tuple(tuple(w.shape[-3:]) for w in weights.values())  # (a layer's)
        for weight, value in weights.items():
            parts = q.quantize(value, fmt)
            for part, array in parts.items():
                setattr(self, param_name(weight, part), nnx.Param(array))
        self.part_names = tuple(parts)
        for bias in self.bias_names():
            setattr(self, bias, nnx.Param(getattr(experts, bias).get_value()))

    def bias_names(self) -> tuple[str, ...]:
        return tuple(f"{w}_bias" for w in weight_names(self.cfg)) if self.cfg.expert_bias \
            else ()

    def parts(self, weight: str) -> q.Parts:
        return {part: getattr(self, param_name(weight, part))[...] for part in self.part_names}

    def weights(self) -> tuple:
        """``(gate, up, down)`` as dicts of parts (each split with its experts under EP), then
        the biases: ``weight_in`` dequantises them where the experts compute."""
        return tuple(self.parts(w) for w in weight_names(self.cfg)) + tuple(
            getattr(self, b)[...] for b in self.bias_names())

    def weight_in(self, weight, dtype):
        if isinstance(weight, dict):
            return q.dequantize(weight, self.fmt, dtype)
        return jnp.asarray(weight, dtype)

    def merged(self) -> Experts:
        """A plain ``moe.Experts``: the dequantised weights (in the dtype they were quantised
        from) and the biases."""
        plain = nnx.eval_shape(lambda: Experts(self.cfg, nnx.Rngs(0)))
        for weight in weight_names(self.cfg):
            setattr(plain, weight, nnx.Param(q.dequantize(self.parts(weight), self.fmt,
                                                          self.param_dtype)))
        for bias in self.bias_names():
            setattr(plain, bias, nnx.Param(getattr(self, bias)[...]))
        return plain


def quantize_experts(model: nnx.Module, fmt: str) -> list[str]:
    """Swap (in place) every ``moe.Experts`` block of ``model`` for ``QuantizedExperts`` of
    ``fmt``; returns their module paths."""
    swapped = []
    for path, experts in modules_of_type(model, Experts):
        replace_module(model, path, QuantizedExperts(experts, fmt))
        swapped.append("/".join(map(str, path)))
    return swapped


def quantized_experts(model: nnx.Module) -> list[tuple[str, QuantizedExperts]]:
    """``[(module path, block)]`` of the model's ``QuantizedExperts`` blocks."""
    return [("/".join(map(str, path)), m) for path, m in nnx.iter_modules(model)
            if path and isinstance(m, QuantizedExperts)]


def weight_parts(model: nnx.Module) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{param path of every part: (its weight's path, a layer's weight shape (E, in, out))}``;
    a stack's parts also under each layer's name, with that layer's weight."""
    out = {}
    for path, block in quantized_experts(model):
        for w, shape in zip(weight_names(block.cfg), block.weight_shapes):
            for part in block.part_names:
                part_path, weight_path = f"{path}/{param_name(w, part)}", f"{path}/{w}"
                out[part_path] = (weight_path, shape)
                if layers_of(path) is not None:
                    out.update((p, (w_path, shape)) for p, w_path in
                               zip(layer_names(part_path), layer_names(weight_path)))
    return out


def parts_of(weight_path: str, w: np.ndarray, fmt: str) -> dict[str, np.ndarray]:
    """``{param path: array}`` of the parts of the weight at ``weight_path`` (E, in, out)."""
    module, _, weight = weight_path.rpartition("/")
    return {f"{module}/{param_name(weight, part)}": np.asarray(v)
            for part, v in q.quantize(w, fmt).items()}


def part_spec(weight_spec: P, shape: tuple[int, ...], mesh=None) -> P:
    """A part's spec from its weight's (E, in, out) spec (a stack's (L, E, in, out): its layer
    entry dropped): 3-D parts as the weight, a per-channel scale (E, out) as its experts and
    output dim, an offset (E,) as its experts; given ``mesh``, a dim of ``shape`` (one layer's
    part) that does not divide by its mesh axes left whole."""
    entries = tuple(weight_spec)[len(weight_spec) > 3:]  # (a stack's: its layer's dropped)
    experts, *kernel = (entries + (None,) * 3)[:3]
    spec = [experts, *q.part_spec(P(*kernel), len(shape) - 1)]
    if mesh is not None:
        spec = [axes if shape[d] % math.prod(mesh.shape[a] for a in (
            (axes,) if isinstance(axes, str) else axes or ())) == 0 else None
            for d, axes in enumerate(spec)]
    return P(*spec)


def part_rules(model: nnx.Module, by_name: list[tuple[str, P]], mesh=None) -> list:
    """Rules giving each part of every ``QuantizedExperts`` block of ``model`` (real or abstract)
    its weight's spec in the rules by name ``by_name`` (``part_spec``); a stack's parts one
    layer's spec (``redco.sharding`` puts the layer axis in front, whole)."""
    rules = []
    for path, block in quantized_experts(model):
        stacked = layers_of(path) is not None
        for weight in weight_names(block.cfg):
            spec = spec_for(f"{path}/{weight}", by_name)
            for part in block.part_names:
                shape = getattr(block, param_name(weight, part)).get_value().shape[stacked:]
                rules.append((f"^{re.escape(path)}/{param_name(weight, part)}$",
                              part_spec(spec, shape, mesh)))
    return rules
