"""The ``safetensors`` checkpoint format for Redco: ``Deployer(checkpoint_format="safetensors")``.

A checkpoint's ``state/`` holds two files:

* ``model.safetensors``: ``params`` under PyTorch names (``torch_name``: ``kernel`` -> ``weight``,
  transposed; ``embedding``/``scale`` -> ``weight``; ``.`` between module names), which is what a
  HuggingFace loader reads for the zoo's models, whose modules are named as HuggingFace's are;
* ``state.safetensors``: everything else (optimizer state, rng) under its redco path.

A stack of layers (``model/layers/0:32/...``, ``redco.layer_stacks``: a model whose layers run
under a scan) is written layer by layer, each under its own layer's name
(``model.layers.7.mlp.up_proj.weight``), as HuggingFace stores them; reading stacks each
layer's slice back.

Writing gathers every array to process 0's host memory (``redco.checkpointing.host_arrays``);
reading slices each shard straight out of the file (``safe_open(...).get_slice``), so every
process reads only what its devices hold, on any mesh. safetensors cannot hold code (no pickle).

``torch_name`` is also the rule ``redco_zoo_models.hf`` uses to read and write HuggingFace
checkpoints: one naming rule, in one place.
"""
from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from redco import hookimpl
from redco.checkpointing import host_arrays, place
from redco.layer_stacks import layer_names, layers_of, unstack
from redco.protocols import CheckpointFormat
from redco.sharding import named_leaves

MODEL_FILE, STATE_FILE = "model.safetensors", "state.safetensors"


def torch_name(path: str, ndim: int) -> tuple[str, tuple[int, ...] | None]:
    """A param's PyTorch name and the axis order that turns the Flax array into PyTorch's
    (``None``: as it is). ``path`` is the param's redco path without ``params/``
    (``model/layers/0/mlp/up_proj/kernel`` -> ``model.layers.0.mlp.up_proj.weight``, ``(1, 0)``)."""
    *modules, leaf = path.split("/")
    perm = None
    if leaf == "kernel" and ndim in (2, 4):
        leaf, perm = "weight", (1, 0) if ndim == 2 else (3, 2, 0, 1)
    elif leaf in ("embedding", "scale"):
        leaf = "weight"
    return ".".join([*modules, leaf]), perm


def stored_names(tree_ndims: dict[str, int]) -> dict[str, tuple[str, str, tuple | None]]:
    """``{path: (file, stored name, perm)}`` for every array (``{path: ndim}``) of a checkpoint
    tree; raises if two arrays would be stored under the same name."""
    names, seen = {}, {}
    for path, ndim in tree_ndims.items():
        if path.startswith("params/"):
            name, perm = torch_name(path[len("params/"):], ndim)
            entry = (MODEL_FILE, name, perm)
        else:
            entry = (STATE_FILE, path, None)
        if entry[:2] in seen:
            raise ValueError(f"{seen[entry[:2]]} and {path} would both be stored as {entry[1]} in "
                             "safetensors; rename one, or use the orbax or msgpack format.")
        seen[entry[:2]] = path
        names[path] = entry
    return names


class SafetensorsFormat(CheckpointFormat):
    def save(self, path: str, tree: Any) -> None:
        arrays = host_arrays(tree)  # a collective: every process takes part
        if jax.process_index() != 0:
            return
        arrays = unstack(arrays)  # a stack's layers each under its own name
        files: dict[str, dict[str, np.ndarray]] = {}
        for p, (file, name, perm) in stored_names({p: a.ndim for p, a in arrays.items()}).items():
            x = arrays[p] if perm is None else arrays[p].transpose(perm)
            files.setdefault(file, {})[name] = np.ascontiguousarray(x)
        os.makedirs(path)
        for file, tensors in files.items():
            save_file(tensors, os.path.join(path, file), metadata={"format": "pt"})

    def load(self, path: str, target: Any) -> Any:
        ndims = {}
        for p, t in named_leaves(target):  # a stack's layers, each stored alone
            ndims.update(dict.fromkeys(layer_names(p), len(t.shape) - 1) if layers_of(p) else
                         {p: len(t.shape)})
        names = stored_names(ndims)
        handles = {file: safe_open(os.path.join(path, file), framework="numpy")
                   for file in {file for file, _, _ in names.values()}}

        def read(p: str, index: tuple) -> np.ndarray:
            if layers_of(p):  # (index: the layer axis's slice first)
                layers = layer_names(p)
                return np.stack([read(layers[i], index[1:])
                                 for i in range(len(layers))[index[0]]])
            file, name, perm = names[p]
            if perm is None:
                return handles[file].get_slice(name)[index] if index else handles[file].get_tensor(name)
            data = handles[file].get_slice(name)[tuple(index[axis] for axis in perm)]
            return data.transpose(np.argsort(perm))
        return place(target, read)


@hookimpl
def register_checkpoint_formats(register):
    register("safetensors", SafetensorsFormat())
