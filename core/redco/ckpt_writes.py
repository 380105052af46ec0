"""Writing checkpoints (``redco/checkpointing.py`` says what one is): as ``<name>.tmp``, renamed
into place by process 0 once every process has written its part, in one go (``save``) or
started on the training thread and finished by a writer thread (``save_in_background``).
``checkpointing`` offers both; this module is its writing half."""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import threading
from typing import Any, Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

from redco import _private, plugins
from redco.tree_paths import named_leaves

# One checkpoint is written or read at a time in a process: a background step checkpoint and a
# best-by-metric one saved meanwhile would otherwise run two writers at once, which orbax is not
# made for (concurrent saves lose files of each other's).
ONE_AT_A_TIME = threading.Lock()


def _sync(tag: str) -> None:  # every process reaches here before any goes on
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(tag)


def _files(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root)
                  for d, _, names in os.walk(root) for f in names)


def sha256(path: str) -> str:
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
    fmt = plugins.lookup("checkpoint_formats", format_name)
    with ONE_AT_A_TIME, _tidied_on_failure(ckpt_dir, name):
        tmp = _begin(ckpt_dir, name)
        fmt.save(os.path.join(tmp, "state"), tree)
        _sync(f"redco-ckpt-written-{name}")
        _commit(ckpt_dir, name, _array_specs(tree), meta, format_name)
        _sync(f"redco-ckpt-done-{name}")
    return os.path.join(ckpt_dir, name)


def save_in_background(ckpt_dir: str, name: str, tree: Any, meta: dict, format_name: str,
                       barrier_tag: str) -> Callable[[], str]:
    """``save``, split in two. Here, on every process's training thread: ``name.tmp`` is made
    and the format's ``start_save`` copies ``tree`` to host memory (what training waits for).
    Returned: the rest, for a writer thread (on every process; it returns the path): the format
    writes this process's part, every process waits at the coordination service's barriers
    (``barrier_tag``: unique to this save), which run nothing on the devices, and process 0
    renames the checkpoint into place once every process has written its part."""
    fmt = plugins.lookup("checkpoint_formats", format_name)
    with ONE_AT_A_TIME, _tidied_on_failure(ckpt_dir, name):
        tmp = _begin(ckpt_dir, name)
        finish = start_save(fmt, os.path.join(tmp, "state"), tree)
    specs = _array_specs(tree)

    def write() -> str:
        with ONE_AT_A_TIME, _tidied_on_failure(ckpt_dir, name):
            finish()
            _barrier(f"{barrier_tag}/written", name)
            _commit(ckpt_dir, name, specs, meta, format_name)
            _barrier(f"{barrier_tag}/done", name)
        return os.path.join(ckpt_dir, name)
    return write


# How long a writer thread waits at a barrier for the other processes to finish their part.
BARRIER_TIMEOUT_S = 3600


def _barrier(tag: str, name: str) -> None:
    """Every process reaches ``tag`` before any goes on: the coordination service's barrier,
    nothing run on the devices (a writer thread waits here while training runs)."""
    if jax.process_count() == 1:
        return
    try:
        _private.wait_at_barrier(_private.coordination_client(), tag, BARRIER_TIMEOUT_S * 1000)
    except jax.errors.JaxRuntimeError as e:
        raise RuntimeError(
            f"Process {jax.process_index()} waited in vain for the other processes to finish "
            f"writing checkpoint {name} ({tag}: {e}). It is not put in place (a partial write "
            "is removed, or left as a .tmp that resume ignores); the checkpoints before it are "
            "kept. See why the other processes stopped, and run the same command again to "
            "resume.") from e


@contextlib.contextmanager
def _tidied_on_failure(ckpt_dir: str, name: str):
    """A failed write's partial directory removed (process 0), a full disk said in one error."""
    try:
        yield
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


def _begin(ckpt_dir: str, name: str) -> str:
    """A fresh ``name.tmp`` (made by process 0, seen by all once they return): its path."""
    tmp = os.path.join(ckpt_dir, name + ".tmp")
    if jax.process_index() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _sync(f"redco-ckpt-start-{name}")
    return tmp


def _array_specs(tree: Any) -> dict[str, list]:
    return {path: [list(np.shape(x)), str(x.dtype)] for path, x in named_leaves(tree)}


def _commit(ckpt_dir: str, name: str, arrays: dict, meta: dict, format_name: str) -> None:
    """Process 0: ``meta.json`` (with every file's size and sha256) into ``name.tmp``, all of it
    flushed to disk, then renamed to ``name`` (replacing any older one)."""
    if jax.process_index() != 0:
        return
    final = os.path.join(ckpt_dir, name)
    tmp, old = final + ".tmp", final + ".old"
    state_dir = os.path.join(tmp, "state")
    files = {}
    for rel in _files(state_dir):
        full = os.path.join(state_dir, rel)
        _fsync(full)
        files[rel] = {"bytes": os.path.getsize(full), "sha256": sha256(full)}
    for directory, _, _ in os.walk(state_dir):
        _fsync(directory)
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


def start_save(fmt: Any, path: str, tree: Any) -> Callable[[], None]:
    """``fmt.start_save(path, tree)``, or where the format has none (``CheckpointFormat``), the
    whole arrays copied to host and a ``finish`` that saves them."""
    if getattr(fmt, "start_save", None) is not None:
        return fmt.start_save(path, tree)
    host = host_tree(tree)
    return lambda: fmt.save(path, host)


def host_tree(tree: Any) -> Any:
    """``tree`` with every array whole in host memory (numpy), sharded across processes or not;
    a collective (call it on every process)."""
    def whole(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        # a copy of a device array (np.asarray may share its buffer, which an update donates)
        return np.array(x) if isinstance(x, jax.Array) else np.asarray(x)
    return jax.tree.map(whole, tree)
