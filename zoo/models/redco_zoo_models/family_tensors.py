"""A decoder family's checkpoint tensors under the zoo model's names, and back.

The zoo's decoder (``redco_zoo_models.decoder``) names its parameters as most families'
checkpoints do, so ``redco_safetensors.torch_name`` maps them; what differs, per family
(``families.FAMILIES``):

* Phi-3 fuses q/k/v (``qkv_proj``) and gate/up (``gate_up_proj``) in its checkpoints:
  ``tensors_in`` splits them and ``tensors_out`` fuses them back, so the model itself (LoRA,
  TP rules, FSDP) sees the same names everywhere.
* Mixture-of-Experts families store one tensor per expert (Qwen3-MoE
  ``mlp.experts.<e>.gate_proj``, Mixtral ``block_sparse_moe.experts.<e>.w1``); they are
  stacked into the zoo's ``mlp.experts.gate_proj`` (experts, in, out) and unstacked on export.
  DeepSeek-V3's (and GLM-4.5's) ``mlp.gate.e_score_correction_bias`` is the block's
  ``balance_bias``; MiniMax-M2 keeps Mixtral's names, its bias as
  ``block_sparse_moe.e_score_correction_bias``.
* Llama 4 names its layers' MLP ``feed_forward`` (the zoo's ``mlp``), its router ``router`` and
  its shared MLP ``shared_expert``; its experts are stacked already, gate and up fused in one
  ``experts.gate_up_proj`` (experts, in, 2 x out), gate the first half.
* Gemma 4's MoE block beside the MLP (the zoo's ``moe``) keeps its router and experts on the
  layer: ``router.proj`` (the zoo's ``gate``), ``router.scale``, ``router.per_expert_scale``;
  its experts stacked as PyTorch's linear weights, (experts, out, in), gate and up fused in one
  ``experts.gate_up_proj`` (experts, 2 x out, in), gate the first half: turned to the zoo's
  (experts, in, out) and split as Llama 4's.
* gpt-oss stores its experts stacked already, as (experts, in, out), but its gate and up
  projections fused in one ``mlp.experts.gate_up_proj`` whose columns alternate (gate, up,
  gate, ...), and their biases so in ``gate_up_proj_bias``; its router is ``mlp.router``.

* Qwen3-Next fuses its Gated DeltaNet's input projections per key head (``in_proj_qkvz``,
  ``in_proj_ba``): split into Qwen3.5's ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
  ``in_proj_a`` on import, fused back on export (``redco_zoo_models.gated_deltanet``); its MoE
  blocks' ``shared_expert`` is the zoo's ``shared_experts``. A Qwen3.5 (or Llama 4)
  multimodal checkpoint's language model is read alone (``_language_model``); Qwen3-Next's
  and Qwen3.5's ``mtp.*`` (multi-token prediction) tensors are not part of the causal LM.

A tied head's stored copy is dropped on import when it equals the embedding (refused when not).
Gemma 4's multimodal checkpoint is read as Qwen3.5's (``model.language_model.*``; its vision
and audio towers dropped), and its KV-sharing layers' key/value tensors, if stored, dropped.
DeepSeek-V3's and GLM-4.5's checkpoints hold their multi-token-prediction layers after the
model's (``model.layers.<num_hidden_layers>...``): not part of the causal LM, they are dropped
on import, as transformers drops them. Granite 4 hybrid's fused shared MLP, stacked experts and conv
weights: ``redco_zoo_models.hybrid_tensors``; Falcon-H1's names: ``redco_zoo_models.falcon_h1``;
Nemotron-H's (``backbone.``, one ``mixer`` a layer): ``redco_zoo_models.nemotron_h``.
"""
from __future__ import annotations

import re

import numpy as np

from redco_zoo_models import falcon_h1, gated_deltanet, hybrid_tensors, nemotron_h
from redco_zoo_models.families import FAMILIES, MTP
from redco_zoo_models.hybrid_tensors import take

FUSED = {"self_attn.qkv_proj.weight": ("q_proj", "k_proj", "v_proj"),
         "mlp.gate_up_proj.weight": ("gate_proj", "up_proj")}
INTERLEAVED = {  # gpt-oss: a fused tensor -> the zoo's (even columns, odd columns)
    "experts.gate_up_proj": ("experts.gate_proj", "experts.up_proj"),
    "experts.gate_up_proj_bias": ("experts.gate_proj_bias", "experts.up_proj_bias"),
}
HALVES = {"experts.gate_up_proj": ("experts.gate_proj", "experts.up_proj")}  # Llama 4's, Gemma 4's
OUT_IN = ("experts.gate_up_proj", "experts.down_proj")  # Gemma 4's: (experts, out, in)
FUSED_DELTA_NET = ("in_proj_qkvz", "in_proj_ba")  # Qwen3-Next's, split into:
SPLIT_DELTA_NET = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
QWEN_EXPERTS = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
EXPERTS = {  # layout -> (the block's checkpoint name, {the zoo's projection: the checkpoint's})
    "qwen": ("mlp", QWEN_EXPERTS),
    "deepseek": ("mlp", QWEN_EXPERTS),
    "mixtral": ("block_sparse_moe", {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}),
    "gpt_oss": ("mlp", {}),  # stacked already (INTERLEAVED)
    "minimax": ("block_sparse_moe", {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}),
    "qwen_next": ("mlp", QWEN_EXPERTS),
    "llama4": ("mlp", {}),  # stacked already (HALVES); its feed_forward is the zoo's mlp
    "gemma4": ("", {}),  # stacked already (OUT_IN, HALVES), on the layer beside its mlp
}
RENAMED = {  # layout -> {the zoo's name in a block: the checkpoint's}
    "qwen": {"gate.weight": "gate.weight"}, "mixtral": {"gate.weight": "gate.weight"},
    "deepseek": {"gate.weight": "gate.weight", "balance_bias": "gate.e_score_correction_bias"},
    "gpt_oss": {"gate.weight": "router.weight", "gate.bias": "router.bias"},
    "minimax": {"gate.weight": "gate.weight", "balance_bias": "e_score_correction_bias"},
    "qwen_next": {"gate.weight": "gate.weight", "shared_expert_gate.weight": "shared_expert_gate.weight",
                  **{f"shared_experts.{p}.weight": f"shared_expert.{p}.weight"
                     for p in QWEN_EXPERTS}},
    "llama4": {"gate.weight": "router.weight", **{f"shared_experts.{p}.weight":
                                                  f"shared_expert.{p}.weight" for p in QWEN_EXPERTS}},
    "gemma4": {"gate.weight": "router.proj.weight", "router_scale": "router.scale",
               "per_expert_scale": "router.per_expert_scale",
               "experts.down_proj": "experts.down_proj"},
}


def _sizes(cfg, fused: str) -> list[int]:
    if fused.startswith("self_attn"):
        kv = cfg.num_key_value_heads * cfg.head_dim
        return [cfg.num_attention_heads * cfg.head_dim, kv, kv]
    return [cfg.intermediate_size] * 2


def tensors_in(cfg, tensors: dict) -> dict:
    """A checkpoint's tensors (PyTorch names) under the zoo model's names (``cfg``: its
    ``DecoderConfig``)."""
    if cfg.family in LANGUAGE_MODELS:
        tensors = _language_model(tensors, *LANGUAGE_MODELS[cfg.family])
    tensors = _without_mtp_layers(cfg, dict(tensors))
    tensors = _without_shared_kv(cfg, tensors)
    tensors = _renamed(cfg, tensors, ".feed_forward.", ".mlp.")
    if cfg.one_block:
        tensors = nemotron_h.tensors_in(cfg, tensors)
    elif FAMILIES[cfg.family].parallel:
        tensors = falcon_h1.tensors_in(cfg, tensors)
    elif FAMILIES[cfg.family].linear == "mamba2":
        tensors = hybrid_tensors.tensors_in(cfg, tensors)
    else:
        tensors = _stacked_experts(cfg, tensors)
    tensors = _delta_nets(cfg, tensors, FUSED_DELTA_NET, gated_deltanet.split_fused)
    if cfg.tie_word_embeddings and "lm_head.weight" in tensors:
        embedding = tensors.get("model.embed_tokens.weight")
        if embedding is None or not np.array_equal(tensors["lm_head.weight"], embedding):
            raise ValueError("config.json ties the output head to the embedding, but the "
                             "checkpoint's lm_head.weight differs from it: set "
                             "tie_word_embeddings to false.")
        del tensors["lm_head.weight"]
    if not FAMILIES[cfg.family].fused:
        return tensors
    for name in [n for n in tensors if any(n.endswith(f) for f in FUSED)]:
        suffix = next(f for f in FUSED if name.endswith(f))
        prefix = name[:-len(suffix)] + suffix.split(".")[0]
        parts = np.split(tensors.pop(name), np.cumsum(_sizes(cfg, suffix))[:-1], axis=0)
        tensors.update({f"{prefix}.{p}.weight": t for p, t in zip(FUSED[suffix], parts)})
    return tensors


def tensors_out(cfg, tensors: dict) -> dict:
    """The zoo model's tensors under its family's checkpoint names (``tensors_in`` undone)."""
    if cfg.one_block:
        tensors = nemotron_h.tensors_out(cfg, tensors)
    elif FAMILIES[cfg.family].parallel:
        tensors = falcon_h1.tensors_out(cfg, tensors)
    elif FAMILIES[cfg.family].linear == "mamba2":
        tensors = hybrid_tensors.tensors_out(cfg, tensors)
    else:
        tensors = _unstacked_experts(cfg, dict(tensors))
    tensors = _delta_nets(cfg, tensors, SPLIT_DELTA_NET, gated_deltanet.fused)
    tensors = _renamed(cfg, tensors, ".mlp.", ".feed_forward.")
    if not FAMILIES[cfg.family].fused:
        return tensors
    for i in range(cfg.num_hidden_layers):
        for suffix, parts in FUSED.items():
            module = f"model.layers.{i}.{suffix.split('.')[0]}"
            tensors[f"model.layers.{i}.{suffix}"] = np.concatenate(
                [tensors.pop(f"{module}.{p}.weight") for p in parts], axis=0)
    return tensors


def _without_mtp_layers(cfg, tensors: dict) -> dict:
    """``tensors`` less a multi-token-prediction family's layers past the model's (docstring)."""
    if not FAMILIES[cfg.family].ignores >= MTP:
        return tensors
    layer = re.compile(r"^model\.layers\.(\d+)\.")
    return {k: v for k, v in tensors.items()
            if not (m := layer.match(k)) or int(m.group(1)) < cfg.num_hidden_layers}


def _without_shared_kv(cfg, tensors: dict) -> dict:
    """``tensors`` less the key/value projections and norms of Gemma 4's layers that share
    another's (``DecoderConfig.kv_source``): a checkpoint may hold them; transformers skips
    them too."""
    shared = [f"model.layers.{i}.self_attn.{p}." for i in range(cfg.num_hidden_layers)
              if cfg.kv_source(i) is not None for p in ("k_proj", "v_proj", "k_norm", "v_norm")]
    return {k: v for k, v in tensors.items() if not k.startswith(tuple(shared))} \
        if shared else tensors


def _renamed(cfg, tensors: dict, ours: str, theirs: str) -> dict:
    """Llama 4's layers' MLP (``feed_forward``) under the zoo's name (``mlp``), or back."""
    if FAMILIES[cfg.family].experts != "llama4":
        return tensors
    return {name.replace(ours, theirs, 1): t for name, t in tensors.items()}


_QWEN3_5 = ("model.language_model.", "model.", ("model.visual.", "mtp."))
LANGUAGE_MODELS = {  # family -> its multimodal checkpoint's (language model's prefix, the
    "qwen3_5_text": _QWEN3_5, "qwen3_5_moe_text": _QWEN3_5,  # causal LM's, prefixes dropped)
    "qwen3_next": _QWEN3_5,
    "llama4_text": ("language_model.", "", ("vision_model.", "multi_modal_projector.")),
    "gemma4_text": ("model.language_model.", "model.", tuple(
        f"model.{part}." for part in ("vision_tower", "embed_vision", "audio_tower",
                                      "embed_audio"))),
}


def _language_model(tensors: dict, prefix: str, ours: str, dropped: tuple) -> dict:
    """A multimodal checkpoint's language model, its ``prefix`` read as ``ours``: Qwen3.5's
    ``model.language_model.*`` as ``model.*``, its vision tower (``model.visual.*``) and
    multi-token-prediction head (``mtp.*``, which transformers' causal LM skips too) dropped;
    Llama 4's ``language_model.*``, its vision tower and projector dropped. A text-only
    checkpoint's names stay as they are."""
    return {ours + name[len(prefix):] if name.startswith(prefix) else name: t
            for name, t in tensors.items() if not name.startswith(dropped)}


def _delta_nets(cfg, tensors: dict, names: tuple[str, ...], convert) -> dict:
    """Each Gated DeltaNet layer's projections ``names`` through ``convert``
    (``gated_deltanet.split_fused`` or ``fused``), for a family that fuses them."""
    if not FAMILIES[cfg.family].fused_delta_net:
        return tensors
    for i in range(cfg.num_hidden_layers):
        if cfg.mixer(i) == "gated_deltanet":
            prefix = f"model.layers.{i}.linear_attn"
            given = [take(tensors, f"{prefix}.{n}.weight", cfg) for n in names]
            tensors.update({f"{prefix}.{n}.weight": t
                            for n, t in convert(cfg.delta_net(), *given).items()})
    return tensors


def _expert_names(cfg):
    """``(the MoE block's zoo prefix, its checkpoint prefix, projections)`` of every sparse
    layer (Gemma 4's block: the zoo's ``moe``, on the checkpoint's layer itself)."""
    block, projections = EXPERTS[FAMILIES[cfg.family].experts]
    ours = "moe" if cfg.moe_beside_mlp else "mlp"
    return [(f"model.layers.{i}.{ours}", ".".join(filter(None, (f"model.layers.{i}", block))),
             projections) for i in range(cfg.num_hidden_layers) if cfg.sparse(i)]


def _stacked_experts(cfg, tensors: dict) -> dict:
    """Each sparse layer's experts as the zoo's stacked (experts, in, out) arrays."""
    layout = FAMILIES[cfg.family].experts
    if not layout:
        return tensors
    for ours, theirs, projections in _expert_names(cfg):
        for projection, stored in projections.items():
            names = [f"{theirs}.experts.{e}.{stored}.weight" for e in range(cfg.n_experts)]
            if missing := [n for n in names if n not in tensors]:
                raise KeyError(f"the checkpoint has no tensor {missing[0]} ({len(missing)} of "
                               f"{cfg.n_experts} experts missing); is it a {cfg.family} "
                               "checkpoint of this config.json?")
            tensors[f"{ours}.experts.{projection}"] = np.stack([tensors.pop(n).T for n in names])
        if layout == "gpt_oss":
            for fused, (even, odd) in INTERLEAVED.items():
                both = take(tensors, f"{theirs}.{fused}", cfg)
                tensors[f"{ours}.{even}"], tensors[f"{ours}.{odd}"] = both[..., ::2], both[..., 1::2]
        if layout == "gemma4":  # (experts, in, out), as the zoo's
            tensors.update({f"{theirs}.{n}": np.swapaxes(take(tensors, f"{theirs}.{n}", cfg), 1, 2)
                            for n in OUT_IN})
        if layout in ("llama4", "gemma4"):
            for fused, halves in HALVES.items():
                tensors.update(zip((f"{ours}.{h}" for h in halves),
                                   np.split(take(tensors, f"{theirs}.{fused}", cfg), 2, -1)))
        for name, stored in RENAMED[layout].items():
            tensors[f"{ours}.{name}"] = take(tensors, f"{theirs}.{stored}", cfg)
    return tensors


def _unstacked_experts(cfg, tensors: dict) -> dict:
    """``_stacked_experts`` undone: the family's names and layout."""
    layout = FAMILIES[cfg.family].experts
    if not layout:
        return tensors
    for ours, theirs, projections in _expert_names(cfg):
        for projection, stored in projections.items():
            stacked = tensors.pop(f"{ours}.experts.{projection}")
            tensors.update({f"{theirs}.experts.{e}.{stored}.weight": stacked[e].T
                            for e in range(cfg.n_experts)})
        if layout == "gpt_oss":
            for fused, (even, odd) in INTERLEAVED.items():
                pair = (tensors.pop(f"{ours}.{even}"), tensors.pop(f"{ours}.{odd}"))
                tensors[f"{theirs}.{fused}"] = np.stack(pair, -1).reshape(*pair[0].shape[:-1], -1)
        if layout in ("llama4", "gemma4"):
            for fused, halves in HALVES.items():
                tensors[f"{theirs}.{fused}"] = np.concatenate(
                    [tensors.pop(f"{ours}.{h}") for h in halves], -1)
        for name, stored in RENAMED[layout].items():
            tensors[f"{theirs}.{stored}"] = tensors.pop(f"{ours}.{name}")
        if layout == "gemma4":  # (experts, out, in), as PyTorch's linear weights
            tensors.update({f"{theirs}.{n}": np.swapaxes(tensors[f"{theirs}.{n}"], 1, 2)
                            for n in OUT_IN})
    return tensors
