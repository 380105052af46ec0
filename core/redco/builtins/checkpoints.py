"""Built-in checkpoint formats. Each writes a pytree of (possibly sharded) arrays to a directory
and reads it back onto whatever shardings the target asks for: another mesh, another number of
processes, one device. None of them can execute code from a file (no pickle).

* ``orbax`` (default): every process writes its own shards (tensorstore); best for big models.
* ``safetensors``: ``model.safetensors`` holds ``params`` under PyTorch names (``kernel`` ->
  ``weight``, transposed; ``embedding``/``scale`` -> ``weight``; ``.`` between names), which is
  what a HuggingFace loader reads for the zoo's models; ``state.safetensors`` holds the rest.
* ``msgpack``: one ``state.msgpack`` of nested dicts, Flax's serialization format (as the
  original Redco wrote), readable with ``flax.serialization.msgpack_restore``.

The last two gather every array to process 0's host memory to write it.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import serialization
from jax.experimental import multihost_utils

from redco.plugins import hookimpl
from redco.sharding import named_leaves


# ---- trees as nested dicts of arrays (what orbax and msgpack store) -----------------------------
def nest(tree) -> dict[str, Any]:
    """``tree``'s arrays as nested dicts keyed by their path's parts (``{"params": {"model":
    ...}}``): plain data, whatever classes (NNX ``State``, optax states) the tree was made of."""
    nested: dict[str, Any] = {}
    for path, x in named_leaves(tree):
        *parents, leaf = path.split("/")
        node = nested
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = x
    return nested


def leaf_at(nested: dict, path: str):
    for key in path.split("/"):
        nested = nested[key]
    return nested


def unflatten_like(target, nested: dict):
    leaves = [leaf_at(nested, path) for path, _ in named_leaves(target)]
    return jax.tree.unflatten(jax.tree.structure(target), leaves)


class OrbaxFormat:
    def save(self, path: str, tree) -> None:
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(path, nest(tree))
            ckptr.wait_until_finished()

    def load(self, path: str, target):
        item = nest(target)
        restore_args = ocp.checkpoint_utils.construct_restore_args(item)
        with ocp.PyTreeCheckpointer() as ckptr:
            restored = ckptr.restore(path, args=ocp.args.PyTreeRestore(
                item=item, restore_args=restore_args, partial_restore=True))
        return unflatten_like(target, restored)


# ---- helpers of the formats that write whole arrays from one process --------------------------
def host_arrays(tree) -> dict[str, np.ndarray]:
    """``{path: whole array}``; a collective (call it on every process)."""
    def whole(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)
    return {path: whole(x) for path, x in named_leaves(tree)}


def place(target, read: Callable[[str, tuple], np.ndarray]):
    """``target``'s pytree of ``ShapeDtypeStruct`` as arrays; ``read(path, index)`` gives the
    numpy data of one shard (``index`` is a tuple of slices), so each process reads only its own."""
    def shard(path, t, index):  # (safetensors hands back a scalar as shape (1,))
        return np.asarray(read(path, index), t.dtype).reshape(t.sharding.shard_shape(t.shape))
    leaves = [jax.make_array_from_callback(t.shape, t.sharding,
                                           lambda index, path=path, t=t: shard(path, t, index))
              for path, t in named_leaves(target)]
    return jax.tree.unflatten(jax.tree.structure(target), leaves)


# ---- safetensors -------------------------------------------------------------------------------
def torch_name(path: str, ndim: int) -> tuple[str, tuple[int, ...] | None]:
    """A param's PyTorch name and the axis order that turns the Flax array into PyTorch's."""
    *modules, leaf = path.split("/")
    perm = None
    if leaf == "kernel" and ndim in (2, 4):
        leaf, perm = "weight", (1, 0) if ndim == 2 else (3, 2, 0, 1)
    elif leaf in ("embedding", "scale"):
        leaf = "weight"
    return ".".join([*modules, leaf]), perm


def _stored_names(tree_paths: dict[str, int]) -> dict[str, tuple[str, str, tuple | None]]:
    """``{path: (file, stored name, perm)}`` for every array of a checkpoint tree."""
    names, seen = {}, {}
    for path, ndim in tree_paths.items():
        if path.startswith("params/"):
            name, perm = torch_name(path[len("params/"):], ndim)
            entry = ("model.safetensors", name, perm)
        else:
            entry = ("state.safetensors", path, None)
        if entry[:2] in seen:
            raise ValueError(f"{seen[entry[:2]]} and {path} would both be stored as {entry[1]} in "
                             "safetensors; rename one, or use the orbax or msgpack format.")
        seen[entry[:2]] = path
        names[path] = entry
    return names


class SafetensorsFormat:
    def save(self, path: str, tree) -> None:
        from safetensors.numpy import save_file
        arrays = host_arrays(tree)
        if jax.process_index() != 0:
            return
        files: dict[str, dict] = {}
        for p, (file, name, perm) in _stored_names({p: a.ndim for p, a in arrays.items()}).items():
            x = arrays[p] if perm is None else arrays[p].transpose(perm)
            files.setdefault(file, {})[name] = np.ascontiguousarray(x)
        os.makedirs(path)
        for file, tensors in files.items():
            save_file(tensors, os.path.join(path, file), metadata={"format": "pt"})

    def load(self, path: str, target):
        from safetensors import safe_open
        names = _stored_names({p: len(t.shape) for p, t in named_leaves(target)})
        handles = {file: safe_open(os.path.join(path, file), framework="numpy")
                   for file in {file for file, _, _ in names.values()}}

        def read(p: str, index: tuple) -> np.ndarray:
            file, name, perm = names[p]
            if perm is None:
                return handles[file].get_slice(name)[index] if index else handles[file].get_tensor(name)
            data = handles[file].get_slice(name)[tuple(index[axis] for axis in perm)]
            return data.transpose(np.argsort(perm))
        return place(target, read)


# ---- msgpack -----------------------------------------------------------------------------------
class MsgpackFormat:
    def save(self, path: str, tree) -> None:
        arrays = host_arrays(tree)
        if jax.process_index() != 0:
            return
        os.makedirs(path)
        with open(os.path.join(path, "state.msgpack"), "wb") as f:
            f.write(serialization.msgpack_serialize(nest(arrays)))

    def load(self, path: str, target):
        with open(os.path.join(path, "state.msgpack"), "rb") as f:
            nested = serialization.msgpack_restore(f.read())
        if not isinstance(nested, dict):
            raise ValueError(f"expected a dict of arrays, found {type(nested).__name__}")

        def read(p: str, index: tuple) -> np.ndarray:
            node = leaf_at(nested, p)
            if not isinstance(node, np.ndarray) or node.dtype.hasobject:
                raise ValueError(f"{p} is a {type(node).__name__}, not an array of numbers")
            return node[index]
        return place(target, read)


@hookimpl(trylast=True)
def register_checkpoint_formats(register):
    register("orbax", OrbaxFormat())
    register("safetensors", SafetensorsFormat())
    register("msgpack", MsgpackFormat())
