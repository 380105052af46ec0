"""Checkpoint directories: written atomically, checked before they are read.

A checkpoint is a directory ``<ckpt_dir>/<name>/`` holding

* ``state/``, the arrays, written by a checkpoint-format plugin (``orbax``, ``safetensors``,
  ``msgpack``, or a third-party one);
* ``meta.json``, the format's name, every array's name, shape and dtype, the size and sha256
  of every file under ``state/``, and what the trainer adds (step, epoch, data position, best
  metrics).

It is written as ``<name>.tmp``, flushed to disk and renamed into place by process 0 only once
every process has written its part (``redco/ckpt_writes.py``: in one go, or, for a step
checkpoint written in the background, copied to host on the training thread and written by a
writer thread), so a crash mid-write never leaves a directory that looks finished; a write that
runs out of disk is removed and said in one error, the earlier checkpoints untouched. Loading
checks that the files are intact and that the arrays fit the target before reading any of them.
Arrays are named by their pytree path joined with ``/`` (``params/model/layers/0/mlp/up_proj/
kernel``); no layout is stored, so a checkpoint restores onto any mesh and any number of processes,
and into the same model with its layers stored the other way, one by one or stacked
(``model/layers/0:4/...``; ``redco/relayout.py``).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any, Callable

import jax
import numpy as np

from redco import plugins, relayout
from redco.ckpt_writes import (  # noqa: F401 (its writing half)
    ONE_AT_A_TIME,
    host_tree,
    save,
    save_in_background,
    sha256,
    start_save,
)
from redco.tree_paths import named_leaves

STEP_DIR = re.compile(r"^step_(\d+)$")


def read_meta(path: str) -> dict:
    """``meta.json`` of the checkpoint at ``path``, or an error saying what is missing."""
    if not os.path.isdir(path):
        parent = os.path.dirname(os.path.abspath(path))
        found = sorted(os.listdir(parent)) if os.path.isdir(parent) else []
        raise FileNotFoundError(f"No checkpoint directory {path}. {parent} holds {found}."
                                if os.path.isdir(parent) else
                                f"No checkpoint directory {path} (nor its parent {parent}).")
    meta_path = os.path.join(path, "meta.json")
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(f"{path} is not a complete redco checkpoint (no meta.json): its "
                                "write was interrupted, or it is not a checkpoint directory.")
    with open(meta_path) as f:
        try:
            meta = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{meta_path} is damaged (not JSON: {e}). Restore it, or delete "
                             f"{path} to use an older checkpoint.") from e
    meta["path"] = path
    return meta


def verify_files(meta: dict) -> None:
    """Raise if any file the checkpoint wrote is missing, truncated or changed since."""
    for rel, want in meta["files"].items():
        full = os.path.join(meta["path"], "state", rel)
        size = os.path.getsize(full) if os.path.isfile(full) else None
        problem = ("is missing" if size is None else
                   f"is truncated or damaged: {size} bytes, but {want['bytes']} were written"
                   if size != want["bytes"] else
                   "is corrupted: its sha256 differs from the one recorded when it was written"
                   if sha256(full) != want["sha256"] else None)
        if problem:
            raise ValueError(f"Checkpoint file {full} {problem}. Delete its directory to use an "
                             "older checkpoint.")


def check_fits(meta: dict, target: Any) -> None:
    """Raise naming the first array of ``target`` the checkpoint lacks or has in another shape."""
    saved, wanted = meta["arrays"], named_leaves(target)
    for path, leaf in wanted:
        if path not in saved:
            names = {p for p, _ in wanted}
            unexpected = [p for p in saved if p not in names][:3]
            raise ValueError(f"Checkpoint {meta['path']} does not match this model: it has no "
                             f"array {path}. Arrays it has that this model lacks: {unexpected}.")
        if list(np.shape(leaf)) != saved[path][0]:
            raise ValueError(f"Checkpoint {meta['path']} does not match this model: {path} has "
                             f"shape {tuple(saved[path][0])} in the checkpoint but "
                             f"{tuple(np.shape(leaf))} here.")


def load(path: str, target: Any) -> tuple[Any, dict]:
    """Read the checkpoint at ``path`` into the shapes, dtypes and shardings of ``target`` (a
    pytree of arrays or ``jax.ShapeDtypeStruct``; it may name a subset of what was saved, such as
    ``{"params": ...}``). Returns ``(tree, meta)``. A checkpoint of the same model with its
    layers stored the other way (one by one, or stacked) is converted (``redco/relayout.py``)."""
    meta = read_meta(path)
    verify_files(meta)
    target = jax.tree.map(_abstract, target)
    source = relayout.source(meta["arrays"], target)  # (its layers in another layout)
    if source is None:
        check_fits(meta, target)
    fmt = plugins.lookup("checkpoint_formats", meta["format"])
    state_dir = os.path.join(meta["path"], "state")
    try:
        with ONE_AT_A_TIME:
            tree = fmt.load(state_dir, target if source is None else nest(source))
    except Exception as e:  # the files are intact (checked above): do not advise deleting them
        raise ValueError(f"Could not read {state_dir} as a {meta['format']} checkpoint "
                         f"({type(e).__name__}: {e}). Its files are intact (sizes and sha256 as "
                         "written), so check the target's dtypes and shardings, and that the "
                         f"{meta['format']} format's version can read what wrote it.") from e
    if source is not None:
        arrays = relayout.in_layout_of(target, tree)
        tree = place(target, lambda name, index: arrays[name][index])
    return tree, meta


def _abstract(x) -> jax.ShapeDtypeStruct:
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, jax.sharding.Sharding):
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)


def recover(ckpt_dir: str | None) -> None:
    """Tidy what a killed ``save`` left (process 0 only): delete unfinished ``<name>.tmp``
    directories, and put back ``<name>.old`` where the kill came between its two renames."""
    if jax.process_index() != 0 or ckpt_dir is None or not os.path.isdir(ckpt_dir):
        return
    for name in os.listdir(ckpt_dir):
        path = os.path.join(ckpt_dir, name)
        if name.endswith(".tmp"):
            shutil.rmtree(path, ignore_errors=True)
        elif name.endswith(".old"):
            if os.path.exists(path[:-len(".old")]):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.rename(path, path[:-len(".old")])


def step_ckpts(ckpt_dir: str | None) -> list[str]:
    """Complete step checkpoints, oldest first (none without a ``ckpt_dir``)."""
    if ckpt_dir is None or not os.path.isdir(ckpt_dir):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(ckpt_dir)
             if (m := STEP_DIR.match(name)) and os.path.isfile(os.path.join(ckpt_dir, name, "meta.json"))]
    return [os.path.join(ckpt_dir, name) for _, name in sorted(found)]


def prune(ckpt_dir: str, keep: int) -> None:
    """Delete all but the newest ``keep`` step checkpoints (process 0 only)."""
    if jax.process_index() == 0:
        for path in step_ckpts(ckpt_dir)[:-keep]:
            shutil.rmtree(path, ignore_errors=True)


# ---- helpers for checkpoint formats: trees as nested dicts, whole arrays on one host ----------
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


def host_arrays(tree) -> dict[str, np.ndarray]:
    """``{path: whole array}``; a collective (call it on every process)."""
    return dict(named_leaves(host_tree(tree)))


def place(target, read: Callable[[str, tuple], np.ndarray]):
    """``target``'s pytree of ``ShapeDtypeStruct`` as arrays; ``read(path, index)`` gives the
    numpy data of one shard (``index`` is a tuple of slices), so each process reads only its own."""
    def shard(path, t, index):  # (safetensors hands back a scalar as shape (1,))
        return np.asarray(read(path, index), t.dtype).reshape(t.sharding.shard_shape(t.shape))
    leaves = [jax.make_array_from_callback(t.shape, t.sharding,
                                           lambda index, path=path, t=t: shard(path, t, index))
              for path, t in named_leaves(target)]
    return jax.tree.unflatten(jax.tree.structure(target), leaves)
