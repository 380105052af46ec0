"""Falcon-H1: attention and Mamba2 side by side in every layer (``Mixer.PARALLEL``).

Each layer norms its input once, then runs both mixers on it: grouped-query attention on the
normed input times ``attention_in_multiplier`` (its keys times ``key_multiplier``), and the
Mamba2 layer (``redco_zoo_models.mamba2``: its input times ``ssm_in_multiplier`` and each part
of ``in_proj``'s output, z, x, B, C and dt, times ``ssm_multipliers``; transformers'
``mup_vector``). The two outputs, times ``attention_out_multiplier`` and
``ssm_out_multiplier``, are summed into the residual; then the MLP (its gate projection times
``mlp_multipliers[0]``, its output times ``mlp_multipliers[1]``). The embeddings are scaled by
``embedding_multiplier`` and the logits by ``lm_head_multiplier``. A decoding layer keeps both
caches: the attention's keys and values and the Mamba2 layer's fixed-size state.

The checkpoint's names differ from the zoo decoder's in a few places (``tensors_in``,
``tensors_out``): the MLP is ``feed_forward`` (the zoo's ``mlp``), the norm before it
``pre_ff_layernorm`` (``post_attention_layernorm``), the final norm ``final_layernorm``
(``norm``), and the convolution's weight is PyTorch's (channels, 1, K).
"""
from __future__ import annotations

import jax.numpy as jnp

RENAMED = ((".feed_forward.", ".mlp."), (".pre_ff_layernorm.", ".post_attention_layernorm."),
           ("model.final_layernorm.", "model.norm."))
CONV = ".mamba.conv1d.weight"


def mixed(layer, h, positions, allowed, layer_cache, cache_index, lengths, segment_ids):
    """``(the two mixers' scaled sum, the layer's cache)`` of the normed input ``h``."""
    cfg = layer.cfg
    scaled = lambda v, m: v if m == 1.0 else v * jnp.asarray(m, v.dtype)  # noqa: E731
    caches = layer_cache or {}
    ssm, ssm_cache = layer._recurrent(h, allowed, caches.get("mamba"), cache_index,
                                      segment_ids)
    attn, attn_cache = layer.self_attn(scaled(h, cfg.attention_in_multiplier), positions,
                                       allowed, caches.get("attention"), cache_index, lengths)
    out = scaled(ssm, cfg.ssm_out_multiplier) + scaled(attn, cfg.attention_out_multiplier)
    return out, None if layer_cache is None else {"attention": attn_cache, "mamba": ssm_cache}


def tensors_in(cfg, tensors: dict) -> dict:
    """A Falcon-H1 checkpoint's tensors under the zoo's names."""
    out = {}
    for name, t in tensors.items():
        for theirs, ours in RENAMED:
            name = name.replace(theirs, ours, 1)
        out[name] = t[:, 0, :] if name.endswith(CONV) else t
    return out


def tensors_out(cfg, tensors: dict) -> dict:
    """``tensors_in`` undone."""
    out = {}
    for name, t in tensors.items():
        for theirs, ours in RENAMED:
            name = name.replace(ours, theirs, 1)
        out[name] = t[:, None, :] if name.endswith(CONV) else t
    return out
