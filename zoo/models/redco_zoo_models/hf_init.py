"""From-scratch parameters drawn as transformers draws them for the checkpoint's family.

transformers' ``_init_weights`` (5.x) of every decoder family here draws linear weights,
embeddings, MoE experts and routers from ``N(0, initializer_range)``, zeroes biases and the
embedding's ``pad_token_id`` row, and sets norm scales to 1 (Gemma's, which scale by
``1 + weight``, to 0). Two families add their own: gpt-oss draws its attention sinks and its
router's bias from the same normal; DeepSeek-V3 zeroes the router's correction bias; the Gated
DeltaNet layers (Qwen3-Next, Qwen3.5) set their gated norm and ``dt_bias`` to 1 and ``A_log`` to
the log of ``U(0.01, 16)``. A Mamba2 layer's convolution is drawn as a linear weight; its
``dt_bias``, ``A_log`` and ``D`` keep the values the layer is built with
(``redco_zoo_models.mamba2``: transformers' 1, log(1..H), 1); Gemma 4 sets its layers'
``layer_scalar`` and its MoE routers' ``scale`` and ``per_expert_scale`` to 1; Nemotron-H
draws its Mamba2 layers' ``dt_bias`` and ``out_proj`` and its padding row its own way
(``redco_zoo_models.nemotron_h.init_like_hf``). Flax's
defaults (LeCun-normal kernels, unit-variance embeddings) instead start a LLaMA's loss at about
``ln V + 1/2``, not ``ln V``.

The rules key on each parameter's path (``model/layers/0/self_attn/q_proj/kernel``); a path no
rule names is an error: a new parameter must say how it starts. A scanned decoder's layers are
drawn before they are stacked (``DecoderModel.stack_layers``), so it starts from the unrolled
model's weights, draw for draw.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from flax import nnx

from redco_zoo_models import nemotron_h

NORMAL, ZEROS, NORM_SCALE, KEEP = "normal", "zeros", "norm_scale", "keep"
ONES, LOG_UNIFORM = "ones", "log_uniform"
RULES = (  # (pattern on the param's path, how it starts); the first that matches decides
    (r"linear_attn/(norm/weight|dt_bias)$", ONES),  # Gated DeltaNet: its gated norm (1 * w)
    (r"linear_attn/A_log$", LOG_UNIFORM),  # log of U(0.01, 16): the heads' decay rates
    (r"linear_attn/conv1d/weight$", NORMAL),
    (r"(^|/)gate/bias$", NORMAL),  # gpt-oss's router bias
    (r"(^|/)(kernel|embedding|sinks)$", NORMAL),
    (r"(^|/)conv1d/weight$", NORMAL),
    (r"(^|/)(dt_bias|A_log|D)$", KEEP),  # (Mamba2: as built)
    (r"(^|/)(layer_scalar|router_scale|per_expert_scale)$", ONES),  # (Gemma 4's)
    (r"(^|/)experts/(gate|up|down)_proj$", NORMAL),  # stacked (experts, in, out)
    (r"(^|/)(bias|(gate|up|down)_proj_bias|balance_bias)$", ZEROS),
    (r"norm(_\d)?/weight$", NORM_SCALE),  # (Gemma 4's MoE block's: layernorm_1, _2)
)


def rule(path: str) -> str:
    """How the param at ``path`` starts (``RULES``); raises for a path no rule names."""
    for pattern, how in RULES:
        if re.search(pattern, path):
            return how
    raise ValueError(f"No from-scratch rule for parameter {path!r}: add one to "
                     "redco_zoo_models.hf_init.RULES (as the family's transformers "
                     "_init_weights draws it).")


def draw(how: str, key, shape: tuple, dtype, std: float, norm_scale: float):
    """One parameter's starting value."""
    if how == NORMAL:
        return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    if how == LOG_UNIFORM:
        return jnp.log(jax.random.uniform(key, shape, jnp.float32, 0.01, 16.0)).astype(dtype)
    if how == ONES:
        return jnp.ones(shape, dtype)
    return jnp.full(shape, norm_scale if how == NORM_SCALE else 0.0, dtype)


def init_like_hf(model: nnx.Module, cfg, rngs: nnx.Rngs) -> None:
    """Redraw every ``nnx.Param`` of ``model`` (a zoo decoder, ``cfg`` its ``DecoderConfig``)
    in place, as transformers initialises the family from scratch: std
    ``cfg.initializer_range``, norm scales ``1 - cfg.norm_offset``, the embedding's
    ``cfg.pad_token_id`` row zero. One param at a time, so the old value is freed as it goes."""
    params = [(path, var) for path, var in nnx.iter_graph(model)
              if isinstance(var, nnx.Param)]
    keys = jax.random.split(rngs.params(), max(len(params), 1))
    for key, (path, var) in zip(keys, params):
        name = "/".join(str(p) for p in path)
        if rule(name) == KEEP:
            continue
        value = draw(rule(name), key, var.shape, var.dtype, cfg.initializer_range,
                     1.0 - cfg.norm_offset)
        if re.search(r"embed_tokens(_per_layer)?/embedding$", name) and \
                cfg.pad_token_id is not None:  # (Gemma 4's per-layer table too)
            value = value.at[cfg.pad_token_id].set(0)
        var.value = value
    if cfg.one_block:  # (Nemotron-H's own draws)
        nemotron_h.init_like_hf(model, cfg, rngs)
