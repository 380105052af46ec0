"""Stacked layers: a param that holds several layers' copies of one weight on a leading axis.

A model that runs a stack of like layers under ``jax.lax.scan`` (the zoo decoder's
``scan_layers``) stores each weight of those layers once, stacked: the key ``a:b`` or ``a:b:c``
in its path (Python's slice notation) says which layers, in order:
``model/layers/0:32/self_attn/q_proj/kernel`` of shape (32, in, out) holds layer 0's to layer
31's ``q_proj`` kernels; ``model/layers/1:24:6/...`` layers 1, 7, 13 and 19 (the second layer
of each group of six). ``unstack`` names each slice as the per-layer model names it
(``model/layers/7/...``), ``stack`` undoes it: checkpoint import and export go through them.

Sharding reads a stacked leaf as its per-layer slice: a rule's spec, written for one layer's
weight, applies to the dims after the layer axis (``layer_spec``), and no spec may split the
layer axis itself (each scan step reads one layer's slice whole from every device).
"""
from __future__ import annotations

import re
from typing import Any

from jax.sharding import PartitionSpec as P

from redco.protocols import UsageError

STACK_KEY = re.compile(r"^(\d+):(\d+)(?::(\d+))?$")


def layers_of(path: str) -> range | None:
    """The layers a stacked param's path holds (``.../0:24:6/...`` -> ``range(0, 24, 6)``),
    None for a per-layer param."""
    for key in path.split("/"):
        if m := STACK_KEY.match(key):
            return range(int(m[1]), int(m[2]), int(m[3] or 1))
    return None


def stack_key(layers: range) -> str:
    """The path key of a stack of ``layers`` (``layers_of`` undone)."""
    step = "" if layers.step == 1 else f":{layers.step}"
    return f"{layers.start}:{layers.stop}{step}"


def layer_shape(path: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """One layer's shape of a param: ``shape`` without the layer axis of a stacked one."""
    return tuple(shape[1:]) if layers_of(path) is not None else tuple(shape)


def layer_spec(path: str, spec: P, ndim: int) -> P:
    """The spec a rule gives a param of ``ndim`` dims, for a stacked one: a spec shorter than the
    param (written for one layer's weight) with the layer axis put in front, unsplit; one of the
    param's rank as given. A spec splitting the layer axis is refused."""
    if layers_of(path) is None or not len(spec):
        return spec
    if len(spec) < ndim:
        return P(None, *spec)
    if spec[0] is not None:
        raise UsageError(f"A sharding rule gives {path} (stacked layers, shape's first dim the "
                         f"layer) the spec {spec}, which splits the layer axis: each scanned "
                         "step reads one layer whole. Write the rule for one layer's weight "
                         f"(e.g. {P(*spec[1:])}), or put None first.")
    return spec


def unstack(named: dict[str, Any]) -> dict[str, Any]:
    """``{path: array}`` with each stacked param cut into its layers, named per layer
    (``model/layers/0:24:6/x`` -> ``model/layers/0/x``, ``model/layers/6/x``, ...)."""
    out = {}
    for path, array in named.items():
        layers = layers_of(path)
        if layers is None:
            out[path] = array
            continue
        if array.shape[0] != len(layers):
            raise ValueError(f"{path} has {array.shape[0]} layers on its first axis; its "
                             f"name says {len(layers)}.")
        out.update(zip(layer_names(path), array))
    return out


def stack(named: dict[str, Any], stacked_paths: list[str], stack_fn) -> dict[str, Any]:
    """``unstack`` undone for ``stacked_paths``: each one's layers taken from ``named``
    (per-layer names) and joined by ``stack_fn`` (``np.stack``); other names kept."""
    out = dict(named)
    for path in stacked_paths:
        names = layer_names(path)
        if missing := [n for n in names if n not in out]:
            raise KeyError(f"no {missing[0]} to stack into {path}")
        out[path] = stack_fn([out.pop(n) for n in names])
    return out


def layer_names(path: str) -> list[str]:
    """A stacked param's per-layer names (``.../0:24:6/x`` -> ``.../0/x``, ``.../6/x``, ...)."""
    layers = layers_of(path)
    key = stack_key(layers)
    return ["/".join(str(layer) if part == key else part for part in path.split("/"))
            for layer in layers]
