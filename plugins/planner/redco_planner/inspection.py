"""What a sharding plan costs, parameter by parameter, without allocating anything.

``plan_table(deployer, params, rules)`` turns the output of ``deployer.get_sharding_rules`` into
rows (path, shape, spec, bytes per device) that ``format_table`` prints and ``draw_png`` plots;
``params`` may be abstract (``jax.eval_shape`` / ``nnx.eval_shape``). ``load_model`` builds the
abstract models the ``redco rules`` and ``redco plan`` commands take by name.

Two imports stay inside the functions that need them, so that neither is a dependency:
matplotlib (``draw_png`` only) and ``redco_zoo_models`` (the models by name only: ``llama-*``,
``qwen3-*``, ``gemma-3-*``, ``phi-4-mini``). Each fails with the ``pip install`` line that fixes
it.
"""
from __future__ import annotations

import importlib
import math
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from redco.protocols import UsageError
from redco.sharding import named_leaves, specs_from_rules
from redco_planner.models import Model, zoo_llama, zoo_models, zoo_preset


# ---- the table ---------------------------------------------------------------------------------
def spec_str(spec: P) -> str:
    """``P(None, 'mp')`` -> ``(None, 'mp')``; replicated -> ``replicated``."""
    if not any(axis is not None for axis in spec):
        return "replicated"
    return "(" + ", ".join("None" if a is None else repr(a) if isinstance(a, str) else str(a)
                           for a in spec) + ")"


def shards(spec: P, mesh) -> int:
    """How many pieces ``spec`` cuts a tensor into on ``mesh``."""
    n = 1
    for axes in spec:
        for axis in (axes,) if isinstance(axes, str) else (axes or ()):
            n *= mesh.shape[axis]
    return n


def plan_table(deployer, params, rules) -> list[dict]:
    """One row per parameter, in the params' flattening order.

    ``deployer`` is a ``Deployer`` (only its ``mesh`` is used); ``params`` real or abstract
    arrays; ``rules`` as returned by ``deployer.get_sharding_rules``. Each row has ``path``,
    ``shape``, ``dtype``, ``spec`` (the ``PartitionSpec`` actually used: a rule that does not
    divide its tensor falls back to replication, as in training), ``shards``, ``bytes`` (the
    whole tensor) and ``bytes_per_device``.
    """
    mesh = deployer.mesh
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the table itself shows what fell back to replication
        specs = specs_from_rules(params, rules, mesh)
    spec_leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P))
    rows = []
    for (path, leaf), spec in zip(named_leaves(params), spec_leaves):
        size = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
        n = shards(spec, mesh)
        rows.append({"path": path, "shape": tuple(leaf.shape), "dtype": str(np.dtype(leaf.dtype)),
                     "spec": spec, "shards": n, "bytes": size, "bytes_per_device": size // n})
    return rows


def totals(rows: list[dict], n_devices: int) -> dict:
    """Bytes in all, per device, the ideal per device (all / n_devices) and their ratio."""
    total = sum(r["bytes"] for r in rows)
    per_device = sum(r["bytes_per_device"] for r in rows)
    ideal = total / n_devices
    return {"n_params": len(rows), "bytes": total, "bytes_per_device": per_device,
            "ideal_bytes_per_device": ideal,
            "replicated_bytes": sum(r["bytes"] for r in rows if r["shards"] == 1),
            "over_ideal": per_device / ideal if ideal else float("nan")}


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def parse_bytes(text: str | int | float) -> int:
    """``"40GB"``, ``"40GiB"``, ``"512MB"``, ``"1.5e9"`` -> bytes. GB/MB/KB/TB are powers of
    1024, as GPU memory is quoted ("a 40 GB A100" holds 40 GiB)."""
    if isinstance(text, (int, float)):
        return int(text)
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]?)(i?B)?\s*", str(text))
    if not match:
        raise ValueError(f"Cannot read {text!r} as a size: use e.g. 40GB, 512MiB or 4e10.")
    return int(float(match.group(1)) * 1024 ** " KMGT".index(match.group(2) or " "))


def format_table(rows: list[dict], mesh_shape: dict) -> str:
    """The rows as aligned text, then the totals against the ideal (fully sharded) size."""
    n_devices = math.prod(mesh_shape.values())
    header = ("path", "shape", "dtype", "spec", "per device")
    body = [(r["path"], "x".join(map(str, r["shape"])) or "()", r["dtype"], spec_str(r["spec"]),
             human_bytes(r["bytes_per_device"])) for r in rows]
    widths = [max(len(line[i]) for line in [header] + body) for i in range(len(header))]
    fmt = lambda line: "  ".join(  # noqa: E731
        cell.rjust(w) if i == len(line) - 1 else cell.ljust(w)
        for i, (cell, w) in enumerate(zip(line, widths))).rstrip()
    t = totals(rows, n_devices)
    mesh = ", ".join(f"{k}={v}" for k, v in mesh_shape.items())
    lines = [fmt(header), fmt(tuple("-" * w for w in widths))] + [fmt(line) for line in body]
    lines += ["",
              f"mesh: {mesh} ({n_devices} devices), {t['n_params']} params",
              f"total: {human_bytes(t['bytes'])} ({t['bytes']} bytes)",
              f"per device: {human_bytes(t['bytes_per_device'])} ({t['bytes_per_device']} bytes), "
              f"ideal (total / {n_devices}): {human_bytes(t['ideal_bytes_per_device'])}, "
              f"{t['over_ideal']:.2f}x ideal",
              f"replicated: {human_bytes(t['replicated_bytes'])} of the total"]
    return "\n".join(lines)


def draw_png(rows: list[dict], path: str, title: str = "") -> None:
    """A bar per parameter: its bytes per device, coloured by its spec. Needs matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("Drawing the plan needs matplotlib, which redco-planner does not depend "
                          "on: pip install matplotlib") from e
    labels = list(dict.fromkeys(spec_str(r["spec"]) for r in rows))
    colours = {s: plt.get_cmap("tab10")(i % 10) for i, s in enumerate(labels)}
    fig, ax = plt.subplots(figsize=(max(6.0, 0.18 * len(rows)), 4.5))
    ax.bar(range(len(rows)), [r["bytes_per_device"] for r in rows],
           color=[colours[spec_str(r["spec"])] for r in rows])
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r["path"] for r in rows], rotation=90, fontsize=6)
    ax.set_ylabel("bytes per device")
    ax.set_title(title)
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colours[s]) for s in labels],
              labels=labels, title="spec", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- abstract models by name ------------------------------------------------------------------
class UnknownModel(UsageError, ValueError):
    """A model name ``load_model`` does not know; the message lists the names it does (the
    ``redco`` command prints it in one line)."""


def preset_names() -> list[str]:
    """Every model ``load_model`` knows by name: ``llama-tiny``, the LLaMA shapes of
    ``LLAMA_PRESETS`` and the published decoders of ``redco_zoo_models.presets.PRESETS``."""
    from redco_planner.vision import vlm_names
    zoo = zoo_models()
    return ["llama-tiny", *zoo.LLAMA_PRESETS, *zoo.presets.PRESETS, *vlm_names()]


def load_model(name: str, seq_len: int = 128, scan_layers: bool | None = None) -> Model:
    """A model by name, built abstractly: ``llama-tiny`` (``LlamaConfig`` defaults), a LLaMA
    shape from ``redco_zoo_models.LLAMA_PRESETS`` (``llama-1b``, ``llama-7b``, ...
    ``llama-65b``), a published decoder from ``redco_zoo_models.presets.PRESETS``
    (``llama-3.1-8b``, ``qwen3-8b``, ``gemma-3-27b``, ``phi-4-mini``, ...), an image-text
    model of ``redco_zoo_models.presets_vlm`` (``qwen2.5-vl-7b``, ...; ``redco_planner.vision``),
    or ``module:function``. The function returns params (real or abstract), ``(params,
    trace_fn)``, or ``(params, trace_fn, loss_fn)`` with ``loss_fn(params, batch)`` on
    ``{"input_ids": int32 (rows, seq_len + 1)}``. Real arrays are turned into shapes.
    ``scan_layers``: a zoo model's layers stacked and scanned (``zoo_decoder``; None: wherever
    the model can)."""
    if ":" not in name:
        zoo = zoo_models()
        if name == "llama-tiny":
            return zoo_llama(seq_len, scan_layers)
        if name in zoo.LLAMA_PRESETS:
            return zoo_llama(seq_len, scan_layers, **zoo.LLAMA_PRESETS[name])
        if name in zoo.presets.PRESETS:
            return zoo_preset(name, seq_len, scan_layers)
        from redco_planner.vision import vlm_names, zoo_vlm
        if name in vlm_names():  # (the image-text presets: tower and projector too)
            return zoo_vlm(name, seq_len, scan_layers)
        raise UnknownModel(f"Unknown model {name!r}: use one of {', '.join(preset_names())}, "
                           "or module:function (a function returning the params).")
    if scan_layers:
        raise UsageError(f"--scan_layers with --model {name}: only the zoo's decoders (the "
                         "models named by preset) stack their layers; drop --scan_layers, or "
                         "build the model scanned in your function.")
    module, _, attr = name.partition(":")
    out = getattr(importlib.import_module(module), attr)()
    parts = list(out) if isinstance(out, tuple) and len(out) in (2, 3) and callable(out[1]) \
        else [out]
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), parts[0])
    model = Model(params=params, trace_fn=parts[1] if len(parts) > 1 else None)
    if len(parts) == 3:
        model.loss_fn = parts[2]
        model.batch = lambda rows: {"input_ids": jax.ShapeDtypeStruct((rows, seq_len + 1),
                                                                      jnp.int32)}
    return model
