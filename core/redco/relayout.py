"""Checkpoints across layer layouts: a checkpoint written by a model storing its layers one by
one (``params/model/layers/0/mlp/up_proj/kernel``, ...) read into the same model storing them
stacked (``params/model/layers/0:4/mlp/up_proj/kernel``, ``redco.layer_stacks``), and the
reverse; params and optimizer state alike (``opt_state/0/mu/model/layers/...``), since every
array is named by its path.

``checkpointing.load`` asks ``source`` whether the checkpoint and the target differ only so (the
same arrays, layer for layer, in the same shapes once stacks are cut into their layers); then
the checkpoint is read in its own layout, each array whole onto the host, and ``in_layout_of``
cuts and joins it into the target's layout, which ``checkpointing.place`` puts onto the target's
shardings. Cost: every array the target needs, whole in host memory on every process, once
(plus a copy of those it stacks), where a restore in the checkpoint's own layout reads only each
process's shards; it is for the resume across the layout change, after which the run writes
checkpoints in its own layout.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from redco.layer_stacks import layer_names, layers_of, stack, unstack
from redco.tree_paths import named_leaves


def per_layer(shapes: dict[str, tuple]) -> dict[str, tuple | None]:
    """``{path: shape}`` with each stacked array's entry cut into its layers' (the layer axis
    dropped); None for a layer of a stack whose first axis is not its number of layers."""
    out: dict[str, tuple | None] = {}
    for path, shape in shapes.items():
        layers = layers_of(path)
        if layers is None:
            out[path] = tuple(shape)
        else:
            fits = len(shape) > 0 and shape[0] == len(layers)
            out.update((name, tuple(shape[1:]) if fits else None) for name in layer_names(path))
    return out


def source(saved: dict[str, list], target: Any) -> dict[str, Any] | None:
    """Where ``target`` (a pytree of ``jax.ShapeDtypeStruct``) holds the checkpoint's layers in
    another layout: ``{path: ShapeDtypeStruct on the host}`` of the checkpoint's arrays that
    hold them, in its layout, in ``target``'s dtypes (``saved`` is its meta's ``{path: [shape,
    dtype]}``). None where every array of ``target`` is saved under its own name (no relayout),
    or where the two differ in more than layout (``check_fits`` then names the mismatch)."""
    wanted = dict(named_leaves(target))
    if all(path in saved for path in wanted):
        return None
    have = per_layer({path: shape for path, (shape, _) in saved.items()})
    need = {name: (shape, leaf.dtype) for path, leaf in wanted.items()
            for name, shape in per_layer({path: leaf.shape}).items()}
    if any(shape is None or have.get(name) != shape for name, (shape, _) in need.items()):
        return None
    host, read = jax.sharding.SingleDeviceSharding(_host_device()), {}
    for path, (shape, _) in saved.items():
        dtypes = [need[name][1] for name in per_layer({path: shape}) if name in need]
        if dtypes:
            read[path] = jax.ShapeDtypeStruct(tuple(shape), dtypes[0], sharding=host)
    return read


def in_layout_of(target: Any, read: Any) -> dict[str, np.ndarray]:
    """``read`` (the arrays ``source`` named, as read in the checkpoint's layout) as ``{path:
    whole array}`` in ``target``'s layout: stacks cut into layers, then joined as ``target``
    stacks them, in layer order."""
    layers = unstack({path: np.asarray(x) for path, x in named_leaves(read)})
    paths = [path for path, _ in named_leaves(target)]
    joined = stack(layers, [path for path in paths if layers_of(path) is not None], np.stack)
    return {path: joined[path] for path in paths}


def _host_device() -> jax.Device:
    """This process's CPU device (where jax has one: a GPU-only platform list may leave it
    out), else its first device."""
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return jax.local_devices()[0]
