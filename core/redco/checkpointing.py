"""Checkpoint directories: written atomically, checked before they are read.

A checkpoint is a directory ``<ckpt_dir>/<name>/`` holding

* ``state/``, the arrays, written by a checkpoint-format plugin (``orbax``, ``safetensors``,
  ``msgpack``, or a third-party one);
* ``meta.json``, the format's name, every array's name, shape and dtype, the size and sha256
  of every file under ``state/``, and what the trainer adds (step, epoch, data position, best
  metrics).

It is written as ``<name>.tmp``, flushed to disk and renamed into place only once complete, so
a crash mid-write never leaves a directory that looks finished; a write that runs out of disk
is removed and said in one error, the earlier checkpoints untouched. Loading checks that the files
are intact and that the arrays fit the target before reading any of them. Arrays are named by
their pytree path joined with ``/`` (``params/model/layers/0/mlp/up_proj/kernel``); no layout
is stored, so a checkpoint restores onto any mesh and any number of processes.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import threading
from typing import Any, Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

from redco import plugins
from redco.tree_paths import named_leaves

STEP_DIR = re.compile(r"^step_(\d+)$")
# One checkpoint is written or read at a time in a process: a background step checkpoint and a
# best-by-metric one saved meanwhile would otherwise run two writers at once, which orbax is not
# made for (concurrent saves lose files of each other's).
_ONE_AT_A_TIME = threading.Lock()


def _sync(tag: str) -> None:  # every process reaches here before any goes on
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(tag)


def _files(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root)
                  for d, _, names in os.walk(root) for f in names)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(ckpt_dir: str, name: str, tree: Any, meta: dict, format_name: str) -> str:
    """Write ``tree`` with the format ``format_name`` and ``meta`` as ``ckpt_dir/name``
    (replacing it). Called on every process; returns the checkpoint's path."""
    with _ONE_AT_A_TIME:
        try:
            return _save(ckpt_dir, name, tree, meta, format_name)
        except Exception as e:
            if jax.process_index() == 0:  # the partial write: its space back
                shutil.rmtree(os.path.join(ckpt_dir, name + ".tmp"), ignore_errors=True)
            if _no_room(e):
                raise OSError(
                    f"No room to write checkpoint {os.path.join(ckpt_dir, name)}: the disk (or a "
                    f"quota or file-size limit) is full ({e}). The checkpoints already in "
                    f"{ckpt_dir} are kept and the partial write is removed: free space, or give a "
                    "workdir on a larger disk, and run the same command again to resume from "
                    "the newest one.") from e
            raise


# How a full disk, a quota or a file-size limit shows: an OSError's errno, or the words of a
# format's own writer (orbax's tensorstore: "Failed to write ... File too large").
NO_ROOM_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
NO_ROOM_WORDS = ("No space left on device", "Disk quota exceeded", "File too large")


def _no_room(error: BaseException | None) -> bool:
    """Whether ``error``, or one it was raised from, says there is no room to write."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in NO_ROOM_ERRNOS or \
                any(words in str(error) for words in NO_ROOM_WORDS):
            return True
        error = error.__cause__ or error.__context__
    return False


def _save(ckpt_dir: str, name: str, tree: Any, meta: dict, format_name: str) -> str:
    fmt = plugins.lookup("checkpoint_formats", format_name)
    final = os.path.join(ckpt_dir, name)
    tmp, old = final + ".tmp", final + ".old"
    if jax.process_index() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _sync(f"redco-ckpt-start-{name}")
    fmt.save(os.path.join(tmp, "state"), tree)
    _sync(f"redco-ckpt-written-{name}")
    if jax.process_index() == 0:
        state_dir = os.path.join(tmp, "state")
        files = {}
        for rel in _files(state_dir):
            full = os.path.join(state_dir, rel)
            _fsync(full)
            files[rel] = {"bytes": os.path.getsize(full), "sha256": _sha256(full)}
        for directory, _, _ in os.walk(state_dir):
            _fsync(directory)
        arrays = {path: [list(np.shape(x)), str(x.dtype)] for path, x in named_leaves(tree)}
        meta = {**meta, "format": format_name, "arrays": arrays, "files": files}
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync(tmp)
        if os.path.exists(final):
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync(ckpt_dir)
        shutil.rmtree(old, ignore_errors=True)
    _sync(f"redco-ckpt-done-{name}")
    return final


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
                   if _sha256(full) != want["sha256"] else None)
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
    ``{"params": ...}``). Returns ``(tree, meta)``."""
    meta = read_meta(path)
    verify_files(meta)
    target = jax.tree.map(_abstract, target)
    check_fits(meta, target)
    fmt = plugins.lookup("checkpoint_formats", meta["format"])
    state_dir = os.path.join(meta["path"], "state")
    try:
        with _ONE_AT_A_TIME:
            tree = fmt.load(state_dir, target)
    except Exception as e:  # the files are intact (checked above): do not advise deleting them
        raise ValueError(f"Could not read {state_dir} as a {meta['format']} checkpoint "
                         f"({type(e).__name__}: {e}). Its files are intact (sizes and sha256 as "
                         "written), so check the target's dtypes and shardings, and that the "
                         f"{meta['format']} format's version can read what wrote it.") from e
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


def host_tree(tree: Any) -> Any:
    """``tree`` with every array whole in host memory (numpy), sharded across processes or not;
    a collective (call it on every process)."""
    def whole(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)
    return jax.tree.map(whole, tree)


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
