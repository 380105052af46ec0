"""A published decoder (``redco_zoo_models.presets``) cut to its first layers, and one layout's
training step compiled at those cuts, so that ``depth_rule`` carries its peak to full depth
(``bench/family_table.py --extrapolate``, ``bench/depth_rule_check.py``).

The cuts of a model whose first layer is of kind ``k`` (its ``layer_types``; one kind where the
preset has none) are ``[k]``, ``[k, k]`` and, for each other kind ``K`` the model has, ``[k, K]``:
Gemma 3 (five sliding-window layers to one global) compiles three, the others two. Each further
layer of the full model then adds the growth measured for its kind (``depth_rule``), its fp32
gradient floor read off the state: the optimizer's two AdamW moments grow by twice the
trainable bytes, so a layer's gradients are ``(state growth - params growth) / 2``.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable

from depth_rule import Compiled, full_peak, layer_growth

LAYER = "layer"  # the one kind of a model without layer_types


def layer_kinds(name: str) -> tuple[str, ...]:
    """The kind of each layer of the preset ``name``."""
    from redco_zoo_models.presets import preset
    config = preset(name)
    return tuple(config.get("layer_types") or (LAYER,) * config["num_hidden_layers"])


def cut_kinds(name: str) -> list[tuple[str, ...]]:
    """The cuts compiled: ``[k]``, ``[k, k]``, then ``[k, K]`` for each other kind ``K``."""
    kinds = layer_kinds(name)
    first = kinds[0]
    return [(first,), (first, first)] + [(first, k) for k in dict.fromkeys(kinds) if k != first]


def cut(name: str, kinds: tuple[str, ...], seq_len: int):
    """The preset ``name`` with only ``len(kinds)`` layers, of these kinds (a ``Model``)."""
    from redco_planner.inspection import zoo_decoder
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

    from redco_planner.planner import try_layout
    out = {}
    for kinds in cut_kinds(name):
        model = cut(name, kinds, seq_len)
        params, loss, trainable = parts(model)
        mp, rules, policy = cand
        layout = try_layout(params, loss, model.batch(1), n, mp, rules, optax.adamw,
                            model.trace_fn, policy, trainable, limit, compute_dtype=compute_dtype)
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
    one = cuts[order[0]]
    counts = Counter(layer_kinds(name))
    counts[layer_kinds(name)[0]] -= 2  # the base cut's two layers
    further = [(counts[k.split(",")[1]], growth(one, cuts[k])) for k in order[1:]]
    return full_peak(state, compiled(cuts[order[1]]), further)


def growth(one: dict, two: dict) -> float:
    """``depth_rule.layer_growth`` from a cut to the cut one layer deeper, the layer's fp32
    gradients ``(state growth - params growth) / 2`` its floor (module docstring)."""
    grads = (two["state"] - one["state"] - (two["params"] - one["params"])) / 2
    return layer_growth(compiled(one), compiled(two), grads)


def compiled(entry: dict) -> Compiled:
    return Compiled(entry["peak"], entry["state"])
