"""Gemma 4's additions to the shared decoder (``redco_zoo_models.decoder``), as transformers'
``Gemma4ForCausalLM`` computes them; the rest of Gemma 4 is Gemma 3's sandwich of norms with
switches (``DecoderConfig``: norms scale by ``weight``, not ``1 + weight``; scores unscaled,
``attention_multiplier`` 1, as the per-head q/k norms fix their size; ``v_norm``).

* Per-layer inputs (``per_layer_input_size`` P, "PLE"): each token gets one P-vector per layer,
  ``(E_pl[id] * sqrt(P) + norm(W x * hidden_size ** -0.5)) / sqrt(2)``, ``E_pl`` a table of
  ``per_layer_vocab_size`` rows of ``layers * P`` (``embed_tokens_per_layer``), ``x`` the
  scaled input embedding, ``W`` ``per_layer_model_projection`` and ``norm`` an RMSNorm over
  each layer's P features. After its MLP, layer ``i`` adds
  ``norm(proj(act(gate(h)) * p_i))`` to its residual stream ``h``.
* ``layer_scalar``: every layer's output is multiplied by its stored scalar (a checkpoint
  buffer; 1 from scratch).
* Full-attention layers have their own head size and key/value heads (``global_head_dim``,
  ``global_kv_heads``) and, with ``k_eq_v``, no ``v_proj``: the values are the keys'
  projection before ``k_norm`` and RoPE. Their RoPE is ``proportional``
  (``redco_zoo_models.rope``).
* KV sharing (``kv_shared_layers`` n): the last n layers compute no keys or values; each
  attends to those of the last earlier layer of its type (``kv_source``), whole: with a cache,
  that layer's cache. Their cache entries are empty; ``double_wide_mlp`` doubles their MLPs.
* The MoE block (``enable_moe_block``, ``moe_beside_mlp``): beside every layer's dense MLP, the
  shared ``redco_zoo_models.moe.MoE`` (``moe``) reads ``pre_feedforward_layernorm_2`` of the
  residual stream ``x`` and routes on ``x`` itself (its router norms and scales it); the MLP's
  output through ``post_feedforward_layernorm_1`` plus the block's through
  ``post_feedforward_layernorm_2`` is what the layer's ``post_feedforward_layernorm`` then
  norms (``with_moe``). Softmax routing, the top-k weights renormalised, then times each
  expert's learned scale (the renormalisation, a factor per token, cancels in the norm of the
  block's output: only the weights themselves show it). The checkpoint's ``router.proj``,
  ``router.scale``, ``router.per_expert_scale`` and packed ``experts.gate_up_proj`` (experts,
  2 x out, in; gate first) are split and renamed on import and fused back on export
  (``family_tensors``).

* With images (``redco_zoo_models.gemma4_vision``, ``use_bidirectional_attention: "vision"``)
  a run of image tokens sees itself both ways in the sliding layers only (``images_slide_only``;
  Gemma 3's do in every layer); the full layers stay causal. Per-layer inputs are made from
  the ids (image tokens looked up as the pad token) and the embeddings with the images in.

Not read yet, refused naming it (``config_keys``): bidirectional attention in a text model. Stacked layers
(``scan_layers``) and context parallelism are refused with per-layer inputs or KV sharing (a
layer reads another's keys, or its own slice of the per-layer inputs).
"""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from redco import sequence_split
from redco_zoo_models.layers import ACTIVATIONS, RMSNorm, embed
from redco_zoo_models.moe import MoE

MOE_NORMS = ("pre_feedforward_layernorm_2", "post_feedforward_layernorm_1",
             "post_feedforward_layernorm_2")  # (the MoE block's input, each output's)


def images_slide_only(cfg) -> bool:
    """Whether image tokens see each other both ways in the sliding layers only (Gemma 4)."""
    return cfg.family == "gemma4_text"


def kv_source(cfg, layer: int) -> int | None:
    """The layer whose keys and values ``layer`` reuses (module docstring), or ``None``: the
    last of the unshared layers whose type (sliding or not) is ``layer``'s."""
    first = cfg.num_hidden_layers - cfg.kv_shared_layers
    if not cfg.kv_shared_layers or layer < first:
        return None
    same = [j for j in range(first) if cfg.sliding(j) == cfg.sliding(layer)]
    return same[-1] if same else None


def check(cfg) -> None:
    """Refuse, before building, a Gemma 4 configuration that cannot run (module docstring)."""
    n, shared = cfg.num_hidden_layers, cfg.kv_shared_layers
    if not 0 <= shared < n:
        raise ValueError(f"num_kv_shared_layers {shared}: it must be at least 0 and below "
                         f"num_hidden_layers ({n}).")
    if orphans := [i for i in range(n - shared, n) if kv_source(cfg, i) is None]:
        raise ValueError(f"layers {orphans} share keys and values (num_kv_shared_layers "
                         f"{shared}), but no earlier layer of their type computes any: "
                         "share fewer layers.")
    if cfg.per_layer_input_size and not cfg.per_layer_vocab_size:
        raise ValueError("hidden_size_per_layer_input needs vocab_size_per_layer_input.")
    if cfg.scan_layers and not scannable(cfg):
        raise ValueError("scan_layers with Gemma 4's KV sharing or per-layer inputs is not "
                         "supported yet (a layer reads another's keys, or its own input): "
                         "set scan_layers=False.")


def scannable(cfg) -> bool:
    """Whether ``cfg``'s layers can run stacked under a scan: not with KV sharing (a layer
    reads another's keys) or per-layer inputs (each layer its own input)."""
    return not (cfg.kv_shared_layers or cfg.per_layer_input_size)


def refuse_split(cfg) -> None:
    """Context parallelism with per-layer inputs or KV sharing, refused while tracing."""
    if (cfg.kv_shared_layers or cfg.per_layer_input_size) and \
            sequence_split.current() is not None:
        raise ValueError(f"{cfg.family}: context parallelism with per-layer inputs or KV "
                         "sharing is not supported yet: run with n_context_shards=1.")


def add_model_parts(model: nnx.Module, cfg, rngs: nnx.Rngs) -> None:
    """The per-layer inputs' table, projection and norm on ``model`` (``DecoderModel``),
    under transformers' names."""
    width = cfg.num_hidden_layers * cfg.per_layer_input_size
    model.embed_tokens_per_layer = nnx.Embed(cfg.per_layer_vocab_size, width, rngs=rngs)
    model.per_layer_model_projection = nnx.Linear(cfg.hidden_size, width, use_bias=False,
                                                  rngs=rngs)
    model.per_layer_projection_norm = RMSNorm(cfg.per_layer_input_size, cfg.rms_norm_eps,
                                              cfg.norm_offset)


def per_layer_inputs(model: nnx.Module, input_ids, x):
    """``(B, T, layers, P)``: each token's input to each layer (module docstring); ``x`` the
    scaled input embeddings of ``input_ids``."""
    cfg = model.cfg
    shape = (*input_ids.shape, cfg.num_hidden_layers, cfg.per_layer_input_size)
    table = embed(model.embed_tokens_per_layer, input_ids).reshape(shape)
    table = table * jnp.asarray(cfg.per_layer_input_size ** 0.5, table.dtype)
    projected = model.per_layer_model_projection(x) * jnp.asarray(cfg.hidden_size ** -0.5,
                                                                  x.dtype)
    projected = model.per_layer_projection_norm(projected.reshape(shape))
    return (projected + table.astype(x.dtype)) * jnp.asarray(2 ** -0.5, x.dtype)


def add_layer_parts(layer: nnx.Module, cfg, rngs: nnx.Rngs) -> None:
    """A decoder layer's per-layer input gate, projection and norm, and its scalar."""
    if cfg.per_layer_input_size:
        d, p = cfg.hidden_size, cfg.per_layer_input_size
        layer.per_layer_input_gate = nnx.Linear(d, p, use_bias=False, rngs=rngs)
        layer.per_layer_projection = nnx.Linear(p, d, use_bias=False, rngs=rngs)
        layer.post_per_layer_input_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.norm_offset)
    if cfg.layer_scalar:
        layer.layer_scalar = nnx.Param(jnp.ones((1,), jnp.float32))
    if cfg.moe_beside_mlp:
        layer.moe = MoE(cfg.moe(), rngs)
        for name in MOE_NORMS:
            setattr(layer, name, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset))


def with_moe(layer: nnx.Module, x, h):
    """``(the dense MLP's output h and the MoE block's, each normed, summed; the block's
    report)`` for the residual stream ``x`` (module docstring)."""
    y, report = layer.moe(layer.pre_feedforward_layernorm_2(x), router_input=x)
    return layer.post_feedforward_layernorm_1(h) + layer.post_feedforward_layernorm_2(y), report


def layer_output(layer: nnx.Module, cfg, h, per_layer_input):
    """A layer's output ``h`` with its per-layer input added and times its scalar."""
    if cfg.per_layer_input_size:
        gated = ACTIVATIONS[cfg.hidden_act](layer.per_layer_input_gate(h)) * per_layer_input
        h = h + layer.post_per_layer_input_norm(layer.per_layer_projection(gated))
    if cfg.layer_scalar:
        h = h * layer.layer_scalar[...].astype(h.dtype)
    return h
