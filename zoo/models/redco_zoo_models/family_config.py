"""A family's ``config.json`` read into ``DecoderConfig`` and written back (``read_config``,
``write_config``), by its data in ``redco_zoo_models.families``: the keys it reads, its windows
(which layers slide), its RoPE (one, or one per layer type as Gemma 3 and OLMo 3), its layers'
token mixers (``layer_types``: attention, or the family's linear mixer, Mamba2 or Gated
DeltaNet). A multimodal checkpoint's config (Qwen3.5's, Llama 4's) is read as its language model's
(``text_part``). Keys are checked first (``redco_zoo_models.config_keys``): one the family does
not read is refused unless it is off or metadata.
"""
from __future__ import annotations

from typing import Any

from redco_zoo_models import config_keys, mamba2
from redco_zoo_models.families import (
    COMMON,
    COMPUTING,
    FAMILIES,
    FULL,
    NOT_YET,
    ROPE_KEYS,
    SLIDING,
    Family,
)
from redco_zoo_models.rope import read_rope

GATED = ("qwen", "smollm3")  # windows only where use_sliding_window
PER_TYPE_ROPE = ("gemma3", "gemma4", "olmo3")  # a RoPE for each layer type (rope_parameters by type)


TEXT_PARTS = {  # a multimodal checkpoint -> the family of its language model, read alone
    "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text", "llama4": "llama4_text",
    "gemma4": "gemma4_text"}


def text_part(config: dict) -> dict:
    """A multimodal config.json (``TEXT_PARTS``: Qwen3.5's, Llama 4's; its ``text_config``
    nested) as its language model's (the head's tying read from either level); any other as it is. Its vision
    tower and multimodal token ids are not the language model's (``family_tensors`` drops the
    tower's tensors); text alone gives every section of Qwen3.5's multimodal RoPE the same
    position, which is plain RoPE."""
    model_type = config.get("model_type")
    if model_type not in TEXT_PARTS or "text_config" not in config:
        return config
    text = {"tie_word_embeddings": config.get("tie_word_embeddings", False),
            **config["text_config"]}
    return {**text, "model_type": TEXT_PARTS[model_type]}


def _layer_types(family: Family, config: dict, n: int) -> tuple | None:
    if family.windows == "gemma4":
        return tuple(config_keys.gemma4_layer_types(config, n))
    if config.get("layer_types"):
        return tuple(config["layer_types"])
    if family.windows == "qwen":
        first = config.get("max_window_layers", n)
        return tuple(SLIDING if i >= first else FULL for i in range(n))
    if family.windows == "smollm3":  # its NoPE layers slide
        nope = config_keys.nope_layers(config, n)["nope_layers"]
        return tuple(SLIDING if i in nope else FULL for i in range(n))
    if family.windows in ("gemma2", "gemma3", "alternate", "olmo3"):  # (alternate: gpt-oss)
        every = {"gemma3": config.get("sliding_window_pattern",
                                      config.get("_sliding_window_pattern", 6)),
                 "olmo3": 4}.get(family.windows, 2)
        return tuple(SLIDING if (i + 1) % every else FULL for i in range(n))
    return None


def _window(family: Family, config: dict) -> int | None:
    if family.windows == "none":
        return None
    if family.windows in GATED and not config.get("use_sliding_window"):
        return None
    return config.get("sliding_window", 4096 if family.windows.startswith("gemma") else None)


def _ropes(family: Family, config: dict, head_dim: int, where: str,
           full_head_dim: int) -> dict:
    """``{"rope": Rope, "local_rope": Rope or None}`` from either layout of the config
    (Gemma 4's full layers: of their own head size, ``full_head_dim``)."""
    longest = config.get("max_position_embeddings", 4096)
    top = {k: config[k] for k in ("rope_theta", "partial_rotary_factor") if k in config}
    if family.rotary_dim and config.get("rotary_dim"):
        top.setdefault("partial_rotary_factor", config["rotary_dim"] / head_dim)
    params = config.get("rope_parameters") or {}
    original = config.get("original_max_position_embeddings")  # Phi-3 keeps it at the top
    if family.windows in PER_TYPE_ROPE:  # (Gemma 3's local theta is its own key)
        full = {**top, **(config.get("rope_scaling") or {}), **(params.get(FULL) or {})}
        local = {"rope_theta": config.get("rope_local_base_freq", 10_000.0)
                 if family.windows == "gemma3" else top.get("rope_theta"),
                 **(params.get(SLIDING) or {})}
        return {"rope": read_rope(full, full_head_dim, longest, f"{where} ({FULL})"),
                "local_rope": read_rope(local, head_dim, longest, f"{where} ({SLIDING})")}
    if family.linear == "gated_deltanet":  # (Qwen3.5's multimodal RoPE: in text, plain RoPE)
        params = {k: v for k, v in params.items() if k not in ("mrope_section", "mrope_interleaved")}
    merged = {**top, **(config.get("rope_scaling") or {}), **params}
    return {"rope": read_rope(merged, head_dim, longest, where, original), "local_rope": None}


def read_config(cls, config: dict, where: str = "config.json") -> Any:
    """``cls`` (``DecoderConfig``) from a HuggingFace ``config.json``'s contents."""
    config = text_part(config)
    model_type = config.get("model_type", "llama")
    family = FAMILIES.get(model_type)
    if family is None:
        lacks = f"; it needs {NOT_YET[model_type]}" if model_type in NOT_YET else ""
        raise ValueError(f"{where}: model_type {model_type!r} is not a decoder family the zoo "
                         f"reads ({', '.join(FAMILIES)}){lacks}.")
    if config.get("use_bidirectional_attention") not in (None, False, "vision"):
        raise ValueError(f"{where}: use_bidirectional_attention is set (an encoder such as "
                         "EmbeddingGemma); the zoo's decoders are causal (\"vision\", where "
                         "only an image's tokens see each other both ways, reads as text).")
    config_keys.check(config, config_keys.read_keys(family, COMMON, ROPE_KEYS), COMPUTING,
                      model_type, where)
    config = {**family.defaults, **config}
    fields = {f: config[k] for f, k in COMMON.items() if config.get(k) is not None}
    fields.setdefault("num_key_value_heads", config["num_attention_heads"])
    fields.setdefault("tie_word_embeddings", family.tied_default)
    for key, (names, default) in family.reads.items():  # (two keys may name one field)
        for field in names if isinstance(names, tuple) else (names,):
            if config.get(key) is not None:
                fields[field] = config[key]
            else:
                fields.setdefault(field, default)
    for name in family.derived:
        try:
            fields.update(config_keys.DERIVED[name].read(config, fields.get("num_hidden_layers")))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e
    for field in ("eos_token_id", "mlp_only_layers", "mlp_multipliers"):  # (hashed: no lists)
        if isinstance(fields.get(field), list):
            fields[field] = tuple(fields[field])
    head_dim = fields.get("head_dim") or fields["hidden_size"] // fields["num_attention_heads"]
    window = _window(family, config)
    if family.linear:
        fields["mixers"] = _mixers(family, config, fields["num_hidden_layers"], where)
    if family.linear == "mamba2":
        fields["mamba"] = mamba2.read_config(config, family.parallel)
    return cls(**fields, **family.switches, family=model_type, sliding_window=window,
               layer_types=_layer_types(family, config, fields["num_hidden_layers"])
               if window else None,
               **_ropes(family, config, head_dim, where, fields.get("global_head_dim") or head_dim))


LAYER_TYPES = {"attention": "attention", "full_attention": "attention", "mamba": "linear",
               "linear_attention": "linear"}  # layer_types' names (older, newer) -> kind


def _mixers(family: Family, config: dict, n: int, where: str) -> tuple[str, ...]:
    """Each layer's token mixer (``decoder_config.Mixer`` values) from ``layer_types`` (Granite's
    older ``layers_block_type``), its linear layers the family's ``linear`` mixer. Without it,
    as transformers reads it: Granite's layers are all Mamba2; Qwen3-Next's and Qwen3.5's every
    ``full_attention_interval``-th layer attends, the rest are linear."""
    if family.parallel:  # (Falcon-H1: every layer both)
        return ("attention_mamba2",) * n
    names = config.get("layer_types") or config.get("layers_block_type")
    if not names:
        every = config.get("full_attention_interval", 4) if family.linear != "mamba2" else 0
        names = [FULL if every and (i + 1) % every == 0 else "linear_attention"
                 for i in range(n)]
    if unknown := sorted({t for t in names if t not in LAYER_TYPES}):
        raise ValueError(f"{where}: layer_types {unknown} are not layers the zoo's "
                         f"{config['model_type']} has ({', '.join(LAYER_TYPES)}).")
    return tuple("attention" if LAYER_TYPES[t] == "attention" else family.linear for t in names)


def write_config(cfg) -> dict:
    """A HuggingFace ``config.json``'s contents for ``cfg`` (transformers 5's layout)."""
    family = FAMILIES[cfg.family]
    out = {"model_type": cfg.family, "architectures": [family.architecture]}
    out.update({k: getattr(cfg, f) for f, k in COMMON.items()})
    if isinstance(out["eos_token_id"], tuple):
        out["eos_token_id"] = list(out["eos_token_id"])
    for key, (names, _) in family.reads.items():
        out[key] = getattr(cfg, names[0] if isinstance(names, tuple) else names)
    for name in family.derived:
        out.update(config_keys.DERIVED[name].write(cfg))
    rope = cfg.rope.to_hf()
    if cfg.local_rope is not None:
        out["rope_parameters"] = {FULL: rope, SLIDING: cfg.local_rope.to_hf()}
    else:
        if cfg.rope.rotary_dim != cfg.head_dim:
            rope["partial_rotary_factor"] = cfg.rope.rotary_dim / cfg.head_dim
        if "original_max_position_embeddings" in rope and family.fused:
            out["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
        out["rope_parameters"] = rope
        out["rope_theta"] = rope["rope_theta"]  # (transformers 4 reads it here)
    if family.linear and not family.parallel:  # (transformers 5's layer type names)
        out["layer_types"] = [FULL if m.value == "attention" else "linear_attention"
                              for m in cfg.mixers]
    if family.linear == "mamba2":
        out.update(mamba2.write_config(cfg.mamba, family.parallel))
    if family.windows != "none":
        out["sliding_window"] = cfg.sliding_window
        out["use_sliding_window"] = cfg.sliding_window is not None
        if cfg.layer_types is not None:
            out["layer_types"] = list(cfg.layer_types)
        if family.windows not in GATED:
            out.pop("use_sliding_window")
    return out
