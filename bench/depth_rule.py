"""Carrying a compiled training step's peak memory from a shallow cut of a decoder to its full
depth, so that a 70-layer model is planned from compiles of 1 and 2 layers (BENCHMARKS.md
sections 27 and 31; ``bench/family_table.py --extrapolate``, ``bench/moe_plans.py``).

A per-device peak is the state (params and optimizer state, known exactly at any depth from
the shardings, nothing compiled) plus the rest (gradients, activations saved for the backward
pass, temporaries). The rule:

    peak(L) = state(L) + rest(d + 1) + sum over the L - d - 1 further layers of growth(kind)
    growth(kind) = max(rest(d + 1 of that kind) - rest(d), the layer's fp32 gradient bytes)

where ``rest(d)`` is the compiled peak minus the state of the model cut to ``d`` layers. The
gradient floor is there because XLA's buffer assignment does not add a layer's worth of
temporaries per layer under remat, so the measured growth alone is noise around it, while a
layer's gradients are live together at the optimizer update. A model whose layers differ in
kind (Gemma 3's sliding-window and global attention) has a growth per kind, each measured from
the same ``d``-layer cut with one more layer of that kind.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Compiled:
    """One compile of a cut: its per-device peak and state (params + optimizer state) bytes."""
    peak: int
    state: int

    @property
    def rest(self) -> int:
        return self.peak - self.state


def layer_growth(shallow: Compiled, deeper: Compiled, grads: float) -> float:
    """What one more layer adds to the peak beyond the state: the measured growth of the rest
    from ``shallow`` to ``deeper`` (one layer more), at least ``grads`` (that layer's fp32
    gradient bytes per device)."""
    return max(deeper.rest - shallow.rest, grads)


def full_peak(state: int, base: Compiled, further: list[tuple[int, float]]) -> int:
    """The peak at full depth: ``state`` (the full model's, from its shardings), the rest of
    ``base`` (the deepest cut all further layers extend), and ``count * growth`` for each
    ``(count, growth)`` kind of further layer."""
    if any(count < 0 for count, _ in further):
        raise ValueError(f"negative layer count in {further}: the cut is deeper than the model")
    return int(state + base.rest + sum(count * growth for count, growth in further))


def extrapolate(at_one: int, at_two: int, more_layers: int) -> int:
    """A figure linear in depth (state, collective bytes): ``at_one`` plus ``more_layers``
    times the growth from ``at_one`` to ``at_two``."""
    return int(at_one + more_layers * (at_two - at_one))
