"""A published decoder (``redco_zoo_models.presets``) cut to its first layers, and one layout's
training step compiled at those cuts, so that ``depth_rule`` carries its peak to full depth
(``bench/family_table.py --extrapolate``, ``bench/depth_rule_check.py``).

The cuts are the model's first ``BASE`` layers (all of one kind ``k`` in every preset here:
Gemma 3's first global layer is its sixth), then that base with one more layer of each kind
``K`` the model has: ``BASE + [k]`` and ``BASE + [K]``. Gemma 3 (five sliding-window layers to
one global) compiles three cuts, the others two. Each further layer of the full model adds the
growth measured for its kind (``depth_rule``), its fp32 gradient floor read off the state: the
optimizer's two AdamW moments grow by twice the trainable bytes, so a layer's gradients are
``(state growth - params growth) / 2``.

Why 3 and 4 layers, not 1 and 2: the first layers are no steady state of XLA's buffer
assignment. Compiled at 1, 2, 3, 4 layers (8 devices, ``mp=1 auto+fsdp``, remat ``full``, LoRA),
the peak beyond the state grows by 283, 265, then 36 MB a layer for Qwen3-4B, and by -9, 107,
then 12 MB for Gemma-3-1B, whose full 26 layers grow by 16 MB a layer on average: carried from
1 and 2 layers, Gemma-3-1B's peak came out 5.6% under its full-depth compile, and Qwen3-4B's
8 x 16 GB LoRA cell "does not fit" (16.6 GB) where from 3 and 4 layers it fits (8.0 GB).
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable

from depth_rule import Compiled, full_peak, layer_growth

LAYER = "layer"  # the one kind of a model without layer_types
BASE = 3  # layers in the base cut (module docstring)


def layer_kinds(name: str) -> tuple[str, ...]:
    """The kind of each layer of the preset ``name``."""
    from redco_zoo_models.presets import preset
    config = preset(name)
    return tuple(config.get("layer_types") or (LAYER,) * config["num_hidden_layers"])


def cut_kinds(name: str) -> list[tuple[str, ...]]:
    """The cuts compiled: the base (``BASE`` layers of the first kind ``k``), the base and a
    ``k`` layer, then the base and a ``K`` layer for each other kind ``K``."""
    kinds = layer_kinds(name)
    base = kinds[:BASE]
    if set(base) != {kinds[0]}:
        raise ValueError(f"{name}'s first {BASE} layers are of kinds {base}: cut_decoders "
                         "needs them of one kind")
    return [base] + [base + (k,) for k in dict.fromkeys((kinds[0],) + kinds)]


def cut(name: str, kinds: tuple[str, ...], seq_len: int):
    """The preset ``name`` with only ``len(kinds)`` layers, of these kinds (a ``Model``)."""
    from redco_planner.models import zoo_decoder
    from redco_zoo_models.decoder import DecoderConfig
    from redco_zoo_models.presets import preset
    config = {**preset(name), "num_hidden_layers": len(kinds)}
    if LAYER not in kinds:
        config["layer_types"] = list(kinds)
    return zoo_decoder(DecoderConfig.from_hf(config), seq_len)


def compile_cuts(name: str, seq_len: int, parts: Callable, n: int, cand: tuple, limit: int,
                 compute_dtype: Any) -> dict[str, dict]:
    """``{cut: {"peak", "state", "params"}}`` for layout ``cand = (mp, rules, remat)``, each
    cut's step compiled; stops after a cut whose peak is over ``limit`` (a deeper model holds
    more) or that fails (``{"error": ...}`` in its place)."""
    import optax

    from redco.sharding import dataflow_trace
    from redco_planner.search import try_layout
    out = {}
    for kinds in cut_kinds(name):
        model = cut(name, kinds, seq_len)
        params, loss, trainable, overrides = parts(model)
        mp, rules, policy = cand
        batch = model.batch(1)  # (the rules traced on the loss trained, as the full model's)
        layout = try_layout(params, loss, batch, n, mp, rules, optax.adamw,
                            dataflow_trace(loss, batch), policy, trainable, limit,
                            compute_dtype=compute_dtype, overrides=overrides)
        failed = layout.error or layout.out_of_memory
        out[",".join(kinds)] = {"error": failed} if failed else {
            "peak": layout.peak_bytes, "state": layout.state_bytes,
            "params": layout.params_bytes}
        if failed or layout.peak_bytes > limit:
            break
    return out


def extrapolated_peak(name: str, state: int, cuts: dict[str, dict]) -> int | None:
    """``depth_rule.full_peak`` of the full model (``state``: its params and optimizer state
    per device) from ``compile_cuts``' output; None where a cut is missing (over the limit,
    failed)."""
    order = [",".join(k) for k in cut_kinds(name)]
    if any("peak" not in cuts.get(k, {}) for k in order):
        return None
    base = cuts[order[0]]
    counts = Counter(layer_kinds(name))
    counts[layer_kinds(name)[0]] -= BASE + 1  # the layers of the deepest cut of that kind
    further = [(counts[k.split(",")[-1]], growth(base, cuts[k])) for k in order[1:]]
    return full_peak(state, compiled(cuts[order[1]]), further)


def growth(one: dict, two: dict) -> float:
    """``depth_rule.layer_growth`` from a cut to the cut one layer deeper, the layer's fp32
    gradients ``(state growth - params growth) / 2`` its floor (module docstring)."""
    grads = (two["state"] - one["state"] - (two["params"] - one["params"])) / 2
    return layer_growth(compiled(one), compiled(two), grads)


def compiled(entry: dict) -> Compiled:
    return Compiled(entry["peak"], entry["state"])
