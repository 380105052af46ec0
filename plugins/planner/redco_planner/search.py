"""Walk a planner's candidate layouts in order: measure each (``redco_planner.measure``), keep
every one measured, and stop at the first that fits.

``Search`` holds the candidates ``(mp, cp, rule set, remat policy)`` in the order
``redco_planner.planner.plan`` decided and the settings every measurement shares;
``try_layout`` measures one and decides whether it fits. A layout whose params and optimizer
state alone are over the usable memory is not compiled; one XLA runs out of memory compiling
does not fit; one that fails for any other reason keeps its exception for the report.
"""
from __future__ import annotations

from typing import Any, Callable

import jax

from redco.sequence_split import SplitNotAsked
from redco_planner.layouts import TriedLayout
from redco_planner.measure import measure


class Search:
    """Measures ``candidates`` (``(mp, cp, rule set, remat policy)``) in order, keeping every
    layout it measured in ``tried``; stops trying cp > 1 once the model is found not to split
    the sequence (``splits_sequence``)."""

    def __init__(self, candidates: list[tuple], settings: dict, try_all: bool,
                 log: Callable[[str], None] | None):
        self.candidates, self.settings, self.try_all = candidates, settings, try_all
        self.log = log or (lambda line: None)
        self.tried: list[TriedLayout] = []
        self.splits_sequence = True

    def run(self, params, loss, trace_fn, trainable=None, rank=None, overrides=None,
            quantized=None) -> TriedLayout | None:
        """The first layout that fits (every one measured with ``try_all``), or None; each
        layout tried is marked with the LoRA ``rank`` and base format ``quantized`` measured."""
        pick = None
        for mp, cp, name, policy in self.candidates:
            if cp > 1 and not self.splits_sequence or \
                    name.endswith("+ep") and mp * cp == self.settings["n_devices"]:
                continue  # (experts split over dp = 1 device: the same as without +ep)
            try:
                layout = try_layout(params, loss, mp=mp, cp=cp, name=name, policy=policy,
                                    trace_fn=trace_fn, trainable=trainable,
                                    compile_all=self.try_all, overrides=overrides,
                                    **self.settings)
            except SplitNotAsked:
                self.splits_sequence = False
                self.log("n_context_shards > 1 not tried: the model's attention cannot run over "
                         "a split sequence (it never asks redco.sequence_split how)")
                continue
            layout.lora_rank, layout.quantized = rank, quantized
            self.tried.append(layout)
            self.log(layout.describe())
            if layout.fits and pick is None:
                pick = layout
                if not self.try_all:
                    break
        return pick


def try_layout(params, loss, batch, n_devices, mp, name, optimizer, trace_fn, policy,
               trainable, usable, accumulate_grad_batches: int = 1, cp: int = 1,
               context_strategy: str = "all_gather", compute_dtype: Any = None,
               compile_all: bool = False, overrides: Callable | None = None) -> TriedLayout:
    """``measure``, with ``fits`` set. A layout whose params and optimizer state alone exceed
    ``usable`` does not fit and is not compiled (unless ``compile_all``); one XLA runs out of
    memory compiling does not fit; one that fails for any other reason could not be measured,
    and keeps the exception."""
    try:
        layout = measure(params, loss, batch, n_devices, mp, name, optimizer, trace_fn,
                         remat=policy, trainable=trainable,
                         accumulate_grad_batches=accumulate_grad_batches,
                         n_context_shards=cp, context_strategy=context_strategy,
                         compute_dtype=compute_dtype,
                         skip_above=None if compile_all else usable, overrides=overrides)
        layout.fits = layout.over_budget is None and layout.peak_bytes <= usable
    except SplitNotAsked:
        raise  # the model, not this layout: the caller stops trying context parallelism
    except Exception as e:  # noqa: BLE001 - reported with the layout, type and message
        failure = f"{type(e).__name__}: {e}"[:800]
        layout = TriedLayout(name, mp, n_devices, remat=policy, n_context_shards=cp)
        if isinstance(e, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(e):
            layout.out_of_memory = failure
        else:
            layout.error = failure
    return layout
