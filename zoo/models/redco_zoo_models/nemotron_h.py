"""Nemotron-H: one block per layer (``DecoderConfig.one_block``), as transformers' ``nemotron_h``.

Each layer is a norm, one block and a residual: a Mamba2 mixer (``M``: ``redco_zoo_models.mamba2``
with heads of ``mamba_head_dim``, the gated RMSNorm over ``n_groups`` groups, ``dt`` clipped
below at ``time_step_min``), grouped-query attention without RoPE (``*``: NoPE, scores scaled by
``head_dim ** -0.5``), an MLP (``-``: ungated, ``down(relu2(up(x)))``) or an MoE block (``E``:
DeepSeek-V3's sigmoid router with its balancing bias, ungated relu2 experts that read and write
``moe_latent_size`` features through ``fc1_latent_proj``/``fc2_latent_proj`` where it is set, and
an ungated shared expert of ``moe_shared_expert_intermediate_size`` on the token itself). The
layers come from ``layers_block_type`` (transformers 5's names) or the hub's
``hybrid_override_pattern`` (one character a layer); in the zoo's decoder a Mamba2 or attention
layer has no MLP and an MLP or MoE layer has no mixer (``Mixer.NONE``).

The checkpoint's names (``tensors_in``, ``tensors_out``): ``backbone.`` (transformers reads
``model.`` too), ``embeddings`` and ``norm_f`` (the zoo's ``embed_tokens`` and ``norm``), each
layer's ``norm`` (the zoo's ``input_layernorm`` before a mixer, ``post_attention_layernorm``
before an MLP) and ``mixer`` (the zoo's ``mamba``, ``self_attn`` or ``mlp``), the convolution's
weight as PyTorch's (channels, 1, K), the experts one tensor each as PyTorch's linear weights
(the zoo's stacked (experts, in, out)), the router's bias ``gate.e_score_correction_bias``
(the zoo's ``balance_bias``). ``mtp.*`` (multi-token prediction) is not the causal LM: dropped.
"""
from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from redco_zoo_models.checkpoint_files import renamed
from redco_zoo_models.mamba2 import Mamba2Config

BLOCKS = {"M": "mamba2", "*": "attention", "-": "none", "E": "none"}  # char -> Mixer value
TYPES = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E",
         "mamba": "M", "attention": "*"}  # layers_block_type's names (newer, older) -> char
MAMBA_KEYS = {  # Mamba2Config field -> (config.json key, its legacy name, transformers' default)
    "n_heads": ("mamba_num_heads", None, 128), "head_dim": ("mamba_head_dim", None, 64),
    "n_groups": ("n_groups", "mamba_n_groups", 8), "state_size": ("ssm_state_size", None, 128),
    "conv_kernel": ("conv_kernel", "mamba_d_conv", 4),
    "chunk_size": ("chunk_size", "mamba_chunk_size", 128),
    "conv_bias": ("use_conv_bias", "mamba_conv_bias", True), "proj_bias": ("use_bias", None, False),
    "activation": ("mamba_hidden_act", None, "silu"),
}
STEPS = {"time_step_min": ("mamba_dt_min", 0.001), "time_step_max": ("mamba_dt_max", 0.1),
         "time_step_floor": ("mamba_dt_init_floor", 1e-4)}  # key -> (legacy name, default)
KEYS = ("layers_block_type", "layer_types", "hybrid_override_pattern", "moe_latent_size",
        *STEPS, *(legacy for legacy, _ in STEPS.values()),
        *(k for key, legacy, _ in MAMBA_KEYS.values() for k in (key, legacy) if k))
IGNORES = frozenset({  # keys transformers' NemotronH reads only to initialise, or not at all
    "time_step_limit", "mamba_dt_limit", "expand", "mamba_expand", "mamba_proj_bias", "use_mamba_kernels",
    "mamba_ssm_cache_dtype", "rescale_prenorm_residual", "residual_in_fp32", "hidden_dropout",
    "num_logits_to_keep", "attention_bias", "n_shared_experts", "moe_shared_expert_overlap",
    "mtp_layers_block_type", "mtp_hybrid_override_pattern", "output_router_logits"})


def blocks(config: dict) -> str:
    """Each layer's block as a ``hybrid_override_pattern`` character (``M``, ``*``, ``-``,
    ``E``), from ``layers_block_type`` or the pattern (neither: transformers' default)."""
    types = config.get("layers_block_type") or config.get("layer_types")
    if types:
        if unknown := sorted(set(types) - set(TYPES)):
            raise ValueError(f"layers_block_type {unknown}: a Nemotron-H layer is one of "
                             f"{sorted(TYPES)}.")
        return "".join(TYPES[t] for t in types)
    pattern = config.get("hybrid_override_pattern") or "ME*-"
    if unknown := sorted(set(pattern) - set(BLOCKS)):
        raise ValueError(f"hybrid_override_pattern {pattern!r}: {unknown} are not blocks "
                         "(M Mamba2, * attention, - MLP, E MoE).")
    return pattern


def read_layers(config: dict, n: int | None = None) -> dict:
    """``DecoderConfig`` fields: the layers (``n`` is ignored, as transformers ignores
    ``num_hidden_layers``: the pattern's length), their mixers, which have experts, and the
    Mamba2 layers' shape."""
    pattern = blocks(config)
    given = {}
    for field, (key, legacy, default) in MAMBA_KEYS.items():
        value = config.get(key, config.get(legacy) if legacy else None)
        given[field] = default if value is None else value
    steps = tuple(float(config.get(key, config.get(legacy, default)))
                  for key, (legacy, default) in STEPS.items())
    mamba = Mamba2Config(config["hidden_size"], d_ssm=given["n_heads"] * given["head_dim"],
                         eps=config.get("layer_norm_epsilon", 1e-5),
                         time_step_limit=(steps[0], float("inf")), time_step_init=steps, **given)
    return {"num_hidden_layers": len(pattern), "mixers": tuple(BLOCKS[c] for c in pattern),
            "mlp_only_layers": tuple(i for i, c in enumerate(pattern) if c != "E"),
            "mamba": mamba, "moe_latent_size": config.get("moe_latent_size") or 0}


def write_layers(cfg) -> dict:
    """``read_layers`` undone: ``layers_block_type`` and the Mamba2 keys."""
    chars = [CHARS.get(cfg.mixer(i).value) or ("E" if cfg.sparse(i) else "-")
             for i in range(cfg.num_hidden_layers)]
    m = cfg.mamba
    return {"layers_block_type": [NAMES[c] for c in chars], **dict(zip(STEPS, m.time_step_init)),
            "moe_latent_size": cfg.moe_latent_size or None,
            **{key: getattr(m, field) for field, (key, _, _) in MAMBA_KEYS.items()}}


CHARS = {"mamba2": "M", "attention": "*"}  # a mixer layer's Mixer value -> its char
NAMES = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}  # (as written)


def init_like_hf(model, cfg, rngs) -> None:
    """What transformers' NemotronH draws its own way from scratch (after ``hf_init``'s
    rules): each Mamba2 layer's ``dt_bias`` the inverse softplus of a ``dt`` log-uniform in
    [time_step_min, time_step_max] (at least time_step_floor), its ``out_proj`` uniform
    (PyTorch's default, bound ``fan_in ** -0.5``) over ``sqrt(num_hidden_layers)``, and the
    embedding's padding row drawn as the rest."""
    for path, var in nnx.iter_graph(model):
        name = "/".join(map(str, path))
        if not isinstance(var, nnx.Param) or not re.search(DRAWN, name):
            continue
        key, shape = rngs.params(), var.shape
        if name.endswith("dt_bias"):
            low, high, floor = (math.log(s) for s in cfg.mamba.time_step_init)
            dt = jnp.maximum(jnp.exp(jax.random.uniform(key, shape, jnp.float32, low, high)),
                             math.exp(floor))
            value = dt + jnp.log(-jnp.expm1(-dt))
        elif name.endswith("kernel"):
            bound = shape[0] ** -0.5
            value = jax.random.uniform(key, shape, jnp.float32, -bound, bound) / math.sqrt(
                cfg.num_hidden_layers)
        else:
            value = cfg.initializer_range * jax.random.normal(key, shape, jnp.float32)
        var.value = value.astype(var.dtype)


DRAWN = r"(mamba/dt_bias|mamba/out_proj/kernel|embed_tokens/embedding)$"


def one_block_norm(cfg, layer: int) -> str:
    """The zoo's name of a ``one_block`` layer's norm: before its MLP or before its mixer."""
    return "post_attention_layernorm" if cfg.has_mlp(layer) else "input_layernorm"


def _renames(cfg) -> list[tuple[str, str]]:
    """``(checkpoint prefix, the zoo's)`` of every renamed module."""
    out = [("model.embeddings.", "model.embed_tokens."), ("model.norm_f.", "model.norm.")]
    for i in range(cfg.num_hidden_layers):
        block = {"mamba2": "mamba", "attention": "self_attn"}.get(cfg.mixer(i).value, "mlp")
        layer = f"model.layers.{i}."
        out += [(f"{layer}norm.", f"{layer}{one_block_norm(cfg, i)}."),
                (f"{layer}mixer.", f"{layer}{block}.")]
    return out


def tensors_in(cfg, tensors: dict) -> dict:
    """A Nemotron-H checkpoint's tensors under the zoo's names (module docstring)."""
    tensors = {"model." + k[len("backbone."):] if k.startswith("backbone.") else k: v
               for k, v in tensors.items() if not k.startswith("mtp.")}
    tensors = renamed(tensors, _renames(cfg))
    for i in range(cfg.num_hidden_layers):
        conv = f"model.layers.{i}.mamba.conv1d.weight"
        if conv in tensors:
            tensors[conv] = tensors[conv][:, 0, :]
        if cfg.sparse(i):
            _experts_in(cfg, tensors, f"model.layers.{i}.mlp")
    return tensors


def _experts_in(cfg, tensors: dict, block: str) -> None:
    """One MoE layer's experts stacked as the zoo's (experts, in, out), its bias renamed."""
    for p in ("up_proj", "down_proj"):
        stacked = f"{block}.experts.{p}"
        if stacked in tensors:  # (stacked already, as PyTorch's (experts, out, in))
            tensors[stacked] = np.swapaxes(tensors[stacked], 1, 2)
            continue
        names = [f"{block}.experts.{e}.{p}.weight" for e in range(cfg.n_experts)]
        if missing := [n for n in names if n not in tensors]:
            raise KeyError(f"the checkpoint has no tensor {missing[0]}; is it a nemotron_h "
                           "checkpoint of this config.json?")
        tensors[stacked] = np.stack([tensors.pop(n).T for n in names])
    tensors[f"{block}.balance_bias"] = tensors.pop(f"{block}.gate.e_score_correction_bias")


def tensors_out(cfg, tensors: dict) -> dict:
    """``tensors_in`` undone, under ``backbone.`` as transformers writes it."""
    tensors = dict(tensors)
    for i in range(cfg.num_hidden_layers):
        conv = f"model.layers.{i}.mamba.conv1d.weight"
        if conv in tensors:
            tensors[conv] = tensors[conv][:, None, :]
        if cfg.sparse(i):
            block = f"model.layers.{i}.mlp"
            for p in ("up_proj", "down_proj"):
                stacked = tensors.pop(f"{block}.experts.{p}")
                tensors.update({f"{block}.experts.{e}.{p}.weight": stacked[e].T
                                for e in range(cfg.n_experts)})
            tensors[f"{block}.gate.e_score_correction_bias"] = tensors.pop(
                f"{block}.balance_bias")
    tensors = renamed(tensors, [(new, old) for old, new in _renames(cfg)])
    return {"backbone." + k[len("model."):] if k.startswith("model.") else k: v
            for k, v in tensors.items()}
