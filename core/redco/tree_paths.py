"""Names of a pytree's leaves: ``"model/layers/0/q_proj/kernel"`` for the path JAX gives a leaf.

Rules, LoRA adapters, checkpoints and plans all address params by these ``/``-joined paths.
"""
from __future__ import annotations

from typing import Any

import jax


def key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_str(path) -> str:
    """``/``-joined key names; a trailing ``.value`` (Flax NNX variables) is dropped."""
    if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
        path = path[:-1]
    return "/".join(key_name(k) for k in path)


def named_leaves(tree) -> list[tuple[str, Any]]:
    """``[(path, leaf), ...]`` in the tree's flattening order."""
    return [(path_str(p), leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]
