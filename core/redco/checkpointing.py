"""Checkpoint directories: written atomically, found again by name.

A checkpoint is a directory ``<ckpt_dir>/<name>/`` holding ``state/`` (written by the
checkpoint-format plugin) and ``meta.json`` (step, epoch, best metrics). It is written under
``<name>.tmp`` and renamed into place only once complete, so a crash mid-write never leaves a
directory that looks finished. Step checkpoints are named ``step_<N>``.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any

import jax
from jax.experimental import multihost_utils

STEP_DIR = re.compile(r"^step_(\d+)$")


def _sync(tag: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(tag)


def save(ckpt_dir: str, name: str, tree: Any, meta: dict, fmt) -> str:
    """Write ``tree`` and ``meta`` as ``ckpt_dir/name`` (replacing it), on every process."""
    final = os.path.join(ckpt_dir, name)
    tmp, old = final + ".tmp", final + ".old"
    if jax.process_index() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _sync(f"redco-ckpt-start-{name}")
    fmt.save(os.path.join(tmp, "state"), tree)
    if jax.process_index() == 0:
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f)
        if os.path.exists(final):
            os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    _sync(f"redco-ckpt-done-{name}")
    return final


def load(path: str, target: Any, fmt) -> tuple[Any, dict]:
    """Read a checkpoint directory back onto ``target``'s shapes and shardings."""
    if not os.path.isfile(os.path.join(path, "meta.json")):
        raise FileNotFoundError(f"{path} is not a complete redco checkpoint (no meta.json).")
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    return fmt.load(os.path.join(path, "state"), target), meta


def step_ckpts(ckpt_dir: str) -> list[str]:
    """Complete step checkpoints, oldest first."""
    if not os.path.isdir(ckpt_dir):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(ckpt_dir)
             if (m := STEP_DIR.match(name)) and os.path.isfile(os.path.join(ckpt_dir, name, "meta.json"))]
    return [os.path.join(ckpt_dir, name) for _, name in sorted(found)]


def prune(ckpt_dir: str, keep: int) -> None:
    """Delete all but the newest ``keep`` step checkpoints (process 0 only)."""
    if jax.process_index() == 0:
        for path in step_ckpts(ckpt_dir)[:-keep]:
            shutil.rmtree(path, ignore_errors=True)
