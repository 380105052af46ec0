"""Flax NNX helpers: a module as what ``Trainer`` takes (an apply function and a params pytree),
and finding and replacing submodules."""
from __future__ import annotations

import inspect
from typing import Any, Callable

from flax import nnx


def split_model(model: nnx.Module) -> tuple[Callable, Any]:
    """``(apply_fn, params)`` with ``apply_fn(params, *args, **kwargs) == model(*args, **kwargs)``
    for the model rebuilt around ``params`` (an ``nnx.State`` of the model's ``nnx.Param``s)."""
    graphdef, params = nnx.split(model, nnx.Param)

    def apply_fn(params, *args, **kwargs):
        return nnx.merge(graphdef, params)(*args, **kwargs)
    # a zoo model that reports metrics (an MoE's experts: ``metrics.logits_and_experts``)
    apply_fn.returns_metrics = "return_metrics" in inspect.signature(type(model).__call__).parameters
    return apply_fn, params


def modules_of_type(model: nnx.Module, kind: type) -> list[tuple[tuple, nnx.Module]]:
    """``[(path, module)]`` of the modules of exactly ``kind`` below the root."""
    return [(path, m) for path, m in nnx.iter_modules(model) if type(m) is kind and path]


def replace_module(model: nnx.Module, path: tuple, new: nnx.Module) -> None:
    """Put ``new`` at ``path`` (attribute names and list indices) in ``model``."""
    parent = model
    for key in path[:-1]:
        parent = parent[key] if isinstance(key, int) else getattr(parent, key)
    if isinstance(path[-1], int):
        parent[path[-1]] = new
    else:
        setattr(parent, path[-1], new)
