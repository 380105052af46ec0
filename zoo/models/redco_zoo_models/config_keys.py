"""Which keys of a decoder family's ``config.json`` the zoo reads, ignores with a warning, or
refuses; and the keys read through a function (``DERIVED``).

A key the family reads (``read_keys``) or that changes nothing a forward pass computes
(``HARMLESS``: bookkeeping every transformers config carries) is taken silently. Every other key
is either

* **a computation key** (``COMPUTING``): one that the transformers class of *some* family here
  reads, the keys the zoo's families read for their own and the few no family here honours
  (``UNHONOURED``: ``mlp_bias``, ``quantization_config``, ...). Set to anything but off
  (``None``, ``False``, 0, empty) it is refused, naming it: a window, a softcap, a bias or MoE
  fields in a config whose family does not have them are never silently dropped, even where
  the family's own transformers class would drop them (a mislabelled ``model_type``);
* or **metadata**: a key no family's transformers class reads (an Unsloth save's
  ``unsloth_version``, a tool's notes, a hub config's legacy copies). It is taken with one
  warning naming every such key, as transformers takes it (stored, never read).

Why this split and not "refuse what the family's own transformers class does not define": an
Unsloth (or any tool's) save adds keys nobody can list in advance, and the user wants the model
loaded; what must never happen is a switch that changes the computation being dropped, and those
are the keys some decoder's transformers class defines: a finite list, checked against
transformers' config classes by ``tests/zoo_parity/test_parity_config_keys.py`` (every key a
family's class defines is read, harmless, or refused).
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Callable

from redco_zoo_models import nemotron_h

HARMLESS = frozenset({  # config.json keys that change nothing a forward pass computes
    "model_type", "architectures", "transformers_version", "torch_dtype", "dtype",
    "_name_or_path", "use_cache", "attention_dropout", "resid_pdrop", "residual_dropout",
    "embd_pdrop", "pretraining_tp", "output_attentions", "output_hidden_states", "return_dict",
    "id2label", "label2id", "problem_type", "tokenizer_class", "_attn_implementation",
    "cache_implementation", "use_bfloat16", "torchscript", "chunk_size_feed_forward",
    "max_length", "min_length", "do_sample", "temperature", "top_k", "top_p", "num_beams",
    "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "num_return_sequences",
    "early_stopping", "bad_words_ids", "prefix", "task_specific_params", "finetuning_task",
    "sep_token_id", "decoder_start_token_id", "forced_bos_token_id", "forced_eos_token_id",
    "max_window_layers", "_sliding_window_pattern", "sliding_window_pattern",
    "keys_to_ignore_at_inference", "tf_legacy_loss", "pruned_heads", "tie_encoder_decoder",
    "is_encoder_decoder",
})
UNHONOURED = frozenset({  # keys a decoder's transformers class reads that no family here honours
    "mlp_bias", "quantization_config",
})
WINDOW_KEYS = frozenset({"layer_types", "sliding_window", "use_sliding_window"})
OFF = (None, False, 0, [], {})


def read_keys(family, common: dict, rope_keys: set) -> set:
    """Every key ``family`` (a ``families.Family``) reads or knows its transformers class
    ignores."""
    read = set(common.values()) | family.own_keys() | rope_keys | WINDOW_KEYS | {
        "rope_local_base_freq", "original_max_position_embeddings",
        "use_bidirectional_attention"}
    return read - (WINDOW_KEYS - family.own_keys()) if family.windows == "none" else read


def computing(families: dict, common: dict, rope_keys: set) -> frozenset:
    """``COMPUTING``: the keys that change what some family computes (module docstring)."""
    return frozenset().union(UNHONOURED, *(read_keys(f, common, rope_keys) - f.ignores
                                           for f in families.values()))


def refuse_bitsandbytes(quantization: dict | None, where: str) -> None:
    """Refuse a bitsandbytes checkpoint (``quant_method: bitsandbytes``, 4 or 8 bits) naming the
    fix: its weights are bitsandbytes' packed codes and quant-state tensors (a flattened layout,
    absmaxes on bitsandbytes' dynamic 8-bit map), which the zoo does not read; the zoo quantises
    a full-precision checkpoint itself as it reads it (``redco_zoo_models.quantize``)."""
    if not isinstance(quantization, dict) or quantization.get("quant_method") != "bitsandbytes":
        return
    bits = "4-bit" if quantization.get("load_in_4bit") else "8-bit"
    raise ValueError(
        f"{where}: a bitsandbytes {bits} checkpoint (quantization_config quant_method "
        "'bitsandbytes'): its weights are in bitsandbytes' packed layout, which the zoo does not "
        "read. Dequantise it with transformers and save it (AutoModelForCausalLM.from_pretrained"
        "(dir).dequantize().save_pretrained(out), where bitsandbytes runs), or take the "
        "checkpoint it was quantised from; then load that with --quantize_base nf4 (the zoo "
        "quantises it to NF4 as it reads it).")


def check(config: dict, read: set, known: frozenset, model_type: str, where: str) -> None:
    """Refuse ``config``'s computation keys the family does not ``read`` (unless off); warn
    once naming its metadata keys (module docstring)."""
    refuse_bitsandbytes(config.get("quantization_config"), where)
    unread = {k: v for k, v in config.items() if k not in read | HARMLESS}
    if refused := sorted(k for k, v in unread.items() if k in known and v not in OFF):
        raise ValueError(f"{where}: a {model_type!r} config with {refused}, which the zoo's "
                         f"{model_type} does not read and which change what a model computes: "
                         "remove them if they are off, or use a model family that has them.")
    if ignored := sorted(k for k in unread if k not in known):
        warnings.warn(f"{where}: ignoring {ignored}: no decoder family's transformers class "
                      "reads them (metadata, such as a tool's version); the model is read "
                      "without them.", stacklevel=3)


@dataclasses.dataclass(frozen=True)
class Derived:
    """Config keys that set ``DecoderConfig`` fields through a function, not as they are."""
    keys: tuple  # the config keys it reads
    read: Callable  # (config, n_layers) -> {field: value}
    write: Callable  # (DecoderConfig) -> {config key: value}


def nope_layers(config: dict, n: int) -> dict:
    """SmolLM3: ``no_rope_layers[i]`` is 1 where layer ``i`` turns RoPE, 0 where it does not
    (NoPE); absent, every ``no_rope_layer_interval``-th layer is NoPE."""
    every = config.get("no_rope_layer_interval") or 4
    flags = config.get("no_rope_layers") or [int((i + 1) % every != 0) for i in range(n)]
    return {"nope_layers": tuple(i for i, turns in enumerate(flags) if not turns)}


CHUNKED = "chunked_attention"  # a Llama 4 layer_types entry


def llama4_layers(config: dict, n: int) -> dict:
    """Llama 4: ``moe_layers`` (absent: every ``interleave_moe_layer_step``-th layer) are the
    sparse ones, the rest dense; ``layer_types``' ``chunked_attention`` layers (absent: those
    that turn RoPE) attend within chunks of ``attention_chunk_size``."""
    step = config.get("interleave_moe_layer_step") or 1
    moe = config.get("moe_layers")
    moe = range(step - 1, n, step) if moe is None else moe
    types = config.get("layer_types") or [
        CHUNKED if i not in nope_layers(config, n)["nope_layers"] else "full_attention"
        for i in range(n)]
    if unknown := sorted(set(types) - {CHUNKED, "full_attention"}):
        raise ValueError(f"layer_types {unknown}: a Llama 4 layer is 'chunked_attention' or "
                         "'full_attention'.")
    return {"mlp_only_layers": tuple(i for i in range(n) if i not in moe),
            "chunked_layers": tuple(i for i, t in enumerate(types) if t == CHUNKED)}


FULL, SLIDING = "full_attention", "sliding_attention"


def gemma4_layer_types(config: dict, n: int) -> list[str]:
    """Gemma 4's ``layer_types`` (absent: five sliding layers to one full), the last layer full
    whatever they say, as transformers forces it."""
    types = list(config.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL
                                                for i in range(n)])
    return types[:-1] + [FULL]


def gemma4_layers(config: dict, n: int) -> dict:
    """Gemma 4's full-attention layers' head size and key/value heads: ``per_layer_config``
    (transformers 5's layout: ``{layer: {head_dim, num_key_value_heads}}`` for each full
    layer), or ``global_head_dim`` (512 when absent) and, with ``attention_k_eq_v``,
    ``num_global_key_value_heads``."""
    per_layer = config.get("per_layer_config")
    if not per_layer:
        kv = config.get("num_global_key_value_heads") if config.get("attention_k_eq_v") else None
        return {"global_head_dim": config.get("global_head_dim") or 512,
                "global_kv_heads": kv or 0}
    full = {str(i) for i, t in enumerate(gemma4_layer_types(config, n)) if t == FULL}
    kinds = {tuple(sorted(v.items())) for v in per_layer.values()}
    if {str(k) for k in per_layer} != full or len(kinds) != 1 or \
            not set(per_layer[next(iter(per_layer))]) <= {"head_dim", "num_key_value_heads"}:
        raise ValueError(f"per_layer_config {per_layer}: the zoo reads one override of "
                         "head_dim and num_key_value_heads for every full-attention layer "
                         f"({sorted(full, key=int)}) and none other.")
    one = dict(kinds.pop())
    return {"global_head_dim": one.get("head_dim", 0),
            "global_kv_heads": one.get("num_key_value_heads", 0)}


GEMMA4_MOE = ("num_experts", "top_k_experts", "moe_intermediate_size")


def gemma4_moe(config: dict, n: int) -> dict:
    """Gemma 4's MoE block beside every layer's MLP (``enable_moe_block``): ``num_experts``
    experts of ``moe_intermediate_size``, ``top_k_experts`` a token. Without the block,
    transformers reads none of the three, nor does the zoo."""
    if not config.get("enable_moe_block"):
        return {}
    if missing := [k for k in GEMMA4_MOE if not config.get(k)]:
        raise ValueError(f"enable_moe_block needs {missing}.")
    return {"moe_beside_mlp": True, **dict(zip(
        ("n_experts", "experts_per_token", "moe_intermediate_size"),
        (config[k] for k in GEMMA4_MOE)))}


DERIVED = {
    "no_rope_layers": Derived(
        ("no_rope_layers", "no_rope_layer_interval"), nope_layers,
        lambda cfg: {"no_rope_layers": [int(i not in cfg.nope_layers)
                                        for i in range(cfg.num_hidden_layers)]}),
    "use_qk_norm": Derived(  # GLM-4.5: per-head q/k norms, or none
        ("use_qk_norm",), lambda config, n: {"qk_norm": "head" if config.get("use_qk_norm")
                                             else None},
        lambda cfg: {"use_qk_norm": cfg.qk_norm == "head"}),
    "use_l2_qk_norm": Derived(  # Llama 4: an L2 norm (no weights) of q and k on RoPE layers
        ("use_qk_norm",), lambda config, n: {"qk_norm": "l2" if config.get("use_qk_norm")
                                             else None},
        lambda cfg: {"use_qk_norm": cfg.qk_norm == "l2"}),
    "llama4_layers": Derived(
        ("moe_layers", "interleave_moe_layer_step", "layer_types"), llama4_layers,
        lambda cfg: {"moe_layers": [i for i in range(cfg.num_hidden_layers) if cfg.sparse(i)],
                     "layer_types": [CHUNKED if i in cfg.chunked_layers else "full_attention"
                                     for i in range(cfg.num_hidden_layers)]}),
    "gemma4_layers": Derived(
        ("per_layer_config", "global_head_dim", "num_global_key_value_heads"), gemma4_layers,
        lambda cfg: {"per_layer_config": {
            str(i): dict(zip(("head_dim", "num_key_value_heads"), cfg.attention_shape(i)))
            for i in range(cfg.num_hidden_layers) if not cfg.sliding(i)}}),
    "gemma4_moe": Derived(
        ("enable_moe_block", *GEMMA4_MOE), gemma4_moe,
        lambda cfg: {"enable_moe_block": cfg.moe_beside_mlp, **(dict(zip(GEMMA4_MOE, (
            cfg.n_experts, cfg.experts_per_token, cfg.moe_intermediate_size)))
            if cfg.moe_beside_mlp else {})}),
    "nemotron_h_layers": Derived(nemotron_h.KEYS, nemotron_h.read_layers,
                                 nemotron_h.write_layers),
}
