"""Turn a Flax NNX module into what ``Trainer`` takes: an apply function and a params pytree."""
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
