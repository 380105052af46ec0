"""The decoder's layers stored stacked and run under ``jax.lax.scan`` (``DecoderConfig.scan_layers``):
one layer traced and compiled per group of like layers, not one per layer, so a training
step's compile time stops growing with depth (``bench/scan_compile.py``).

**Groups of a repeating pattern.** Layers of one *kind* (``kind_of``: the same modules, static
attributes and param shapes: a sliding window, a MoE block change it) can share one traced
body. ``segments`` covers the stack, from its first layer, with runs of a repeating group: at
each place it takes the group of at most ``MAX_PERIOD`` layers whose repeats cover the most
layers (ties: the shorter group), or one layer alone when nothing repeats. So LLaMA is one run
of single layers; Gemma 3's five sliding + one global layers are groups of six (its last
layers, fewer than a group, runs of their own); DeepSeek-V3 a run of its first dense layers
then one of its MoE layers.

**Stored stacked.** Each run's ``p``-th layers of every group are one module whose params carry
the layers on a leading axis, named by the layers they hold in Python's slice notation
(``redco.layer_stacks``): LLaMA's 32 layers are ``model/layers/0:32/self_attn/q_proj/kernel``
of shape (32, in, out); Gemma 3's (26 layers) ``model/layers/0:24:6/...`` (layers 0, 6, 12,
18), ..., ``model/layers/5:24:6/...``, then ``model/layers/24/...`` and ``model/layers/25/...``
as unrolled. The layers are built one by one (the unrolled model's initial values, from the
same seed) and stacked once, at construction. HuggingFace import and export cut the stacks
into per-layer tensors and back (``redco.layer_stacks.unstack``/``stack``, ``hf``).

**Run.** A training or scoring forward (no cache) scans each run: ``jax.lax.scan`` over the
stacked params, one group per step, each layer of the group merged from its slice; no copy of
the params is made. ``remat.layer`` policies apply inside the body as to an unrolled layer (but
``"none"``, which keeps there what ``remat.SCANNED_NONE`` keeps: ``remat.scanned_body``),
and under FSDP each slice is declared as its stack is, less the layer axis
(``redco.fsdp.slices_of``), so each step gathers one layer's weights. The KV-cache path
(generation: ``generate``, the engine's slot cache and its paged pool, which gathers pages into
the same slots) is scanned too: the cache stays a list of per-layer caches at the model's
interface (the engine, its pages and ``generate`` are unchanged), and each stacked segment's
layers' caches are stacked on a leading axis for the scan's ``xs``, its ``ys`` (the written
caches) cut back into the list; so a prefill or decode step traces one body per group, not one
per layer, and its compile time stays flat in depth (``bench/serve_startup.py``). The price is
a copy of the cache into and out of the stack in each step. The cache path stays unrolled (a
Python loop, each layer its slice of the stacks: ``each_layer``) for Qwen3-VL's ``deepstack``
(image features added after given layers) and Gemma 4's shared keys and per-layer inputs
(refused with ``scan_layers`` anyway: ``gemma4``).

**Context parallelism** runs inside the body as in an unrolled layer: the split sequence
(``context_parallel.SplitSequence``) is closed over by the body, so each scanned layer's attention
runs in its ``shard_map`` over the sequence axis and the norms and MLPs on each device's tokens.

**LoRA** (``redco_zoo_models.lora``): a stacked projection's adapters are stacked with its
kernel, ``A`` (L, in, r) and ``B`` (L, r, out), and sliced with it in the body; each layer's
drawn as its unrolled copy's, so a scanned LoRA run is the unrolled one.

**Expert parallelism** (``redco_zoo_models.expert_parallel``): the ``+ep`` rule sets split a
stack of experts (layers, experts, in, out) on its experts over ``dp``, the layer axis whole;
the decoder enters EP around the scan as around unrolled layers, each step's MoE block then
sends its tokens to its layer's experts (``all_to_all``) where they lie, ungathered.

**Vision towers** (``qwen_vision``, ``qwen3_vision``, ``clip_vision`` and SigLIP's): under the
language model's ``scan_layers`` the image-text model stacks its tower's blocks too
(``visual/blocks/0:27/...``, ``vision_tower/encoder/layers/0:27/...``) and runs them by
``blocks``. Qwen2.5-VL's window and full-attention blocks are kinds of their own (a block's
static ``full``), so ``segments`` finds their repeating group (7-B: 7 windowed + 1 full, 4
times); hidden states read after given blocks (Qwen3-VL's DeepStack taps, LLaVA's
``vision_feature_layer``) are the scan's ``ys`` (one hidden state a block kept: ``keep``).

**A quantised base** (QLoRA, ``redco_zoo_models.quantized_linear``): a stacked projection's
codes and scales are each layer's quantised alone, stacked, and sliced with it in the body.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Hashable, Iterator, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from redco import fsdp, remat
from redco.layer_stacks import stack_key

MAX_PERIOD = 8  # the longest group of layers a segment repeats


@dataclasses.dataclass(frozen=True)
class Segment:
    """Layers ``start .. start + period * repeats - 1``: a group of ``period`` layers repeated."""
    start: int
    period: int
    repeats: int

    @property
    def stop(self) -> int:
        return self.start + self.period * self.repeats

    def keys(self) -> list[str]:
        """The ``layers`` keys of its modules: one per position in the group (stacked), or the
        layer's index for a layer alone."""
        if self.repeats == 1:
            return [str(self.start)]
        return [stack_key(range(self.start + p, self.stop, self.period))
                for p in range(self.period)]


def kind_of(layer: nnx.Module) -> Hashable:
    """What must match for layers to share a traced body: their graph (modules and static
    attributes such as a window) and their state's shapes and dtypes."""
    graph, state = nnx.split(layer)
    return graph, tuple((x.shape, x.dtype) for x in jax.tree.leaves(state))


def segments(kinds: Sequence[Hashable], max_period: int = MAX_PERIOD) -> list[Segment]:
    """Cover ``kinds`` (one per layer) with segments, greedily from the first layer (module
    docstring)."""
    out, start, n = [], 0, len(kinds)
    while start < n:
        best = Segment(start, 1, 1)
        for period in range(1, min(max_period, (n - start) // 2) + 1):
            group, repeats = kinds[start:start + period], 1
            while start + (repeats + 1) * period <= n and \
                    kinds[start + repeats * period:start + (repeats + 1) * period] == group:
                repeats += 1
            if repeats > 1 and period * repeats > best.period * best.repeats:
                best = Segment(start, period, repeats)
        out.append(best)
        start = best.stop
    return out


def stacked(layers: list[nnx.Module]) -> tuple[nnx.Dict, tuple[Segment, ...]]:
    """``layers`` as ``(modules by key, segments)``: each segment's modules (``Segment.keys``)
    with their layers' state stacked on a leading axis, or a layer alone as it is."""
    runs = tuple(segments([kind_of(layer) for layer in layers]))
    modules = {}
    for seg in runs:
        for p, key in enumerate(seg.keys()):
            group = layers[seg.start + p:seg.stop:seg.period]
            if len(group) == 1:
                modules[key] = group[0]
                continue
            split = [nnx.split(layer) for layer in group]
            modules[key] = nnx.merge(split[0][0], jax.tree.map(lambda *xs: jnp.stack(xs),
                                                              *[state for _, state in split]))
    return nnx.Dict(modules), runs


def each_layer(modules: nnx.Dict, runs: Sequence[Segment]) -> Iterator[nnx.Module]:
    """Every layer in order, a stacked one merged from its slice (the unrolled cache path)."""
    for seg in runs:
        split = [nnx.split(modules[key]) for key in seg.keys()]
        for r in range(seg.repeats):
            for graph, state in split:
                yield nnx.merge(graph, state if seg.repeats == 1 else
                                jax.tree.map(lambda a: a[r], state))


def run(modules: nnx.Dict, runs: Sequence[Segment], step: Callable, x: Any,
        caches: list | None = None, unroll: int = 1) -> tuple[Any, list | None, list]:
    """``x`` through every layer by ``step(layer, x, cache) -> (x, cache, report)``: each
    stacked segment under ``jax.lax.scan``, one group a step; a layer alone called once.
    ``caches``: one per layer (the KV-cache path), each scanned layer's stacked over its
    repeats as the scan's ``xs`` and its new cache its ``ys``; None: ``step`` gets None.
    ``unroll``: groups one step of a scan runs (``jax.lax.scan``'s ``unroll``).
    Returns ``(x, new caches (one per layer; None without), reports)``, a scanned layer's
    report's leaves stacked over its repeats."""
    reports, out = [], None if caches is None else list(caches)
    for seg in runs:
        if seg.repeats == 1:
            x, cache, report = step(modules[seg.keys()[0]], x,
                                    None if caches is None else caches[seg.start])
            reports.append(report)
            layers = {seg.start: cache}
        else:
            x, scanned, written = _scanned(modules, seg, step, x, caches, unroll)
            reports.extend(scanned)
            layers = dict(zip(_layer_order(seg), _unstacked(seg, written)))
        if out is not None:
            for index, cache in layers.items():
                out[index] = cache
    return x, out, reports


def _scanned(modules: nnx.Dict, seg: Segment, step: Callable, x: Any, caches: list | None,
             unroll: int):
    """One stacked segment under ``jax.lax.scan``: ``(x, reports, new caches)``, the last a
    list over the group's positions of caches stacked over the repeats (None without)."""
    graphs, states = zip(*[nnx.split(modules[key]) for key in seg.keys()])
    stacks = [jax.tree.leaves(state) for state in states]
    stacked = None if caches is None else [
        jax.tree.map(lambda *xs: jnp.stack(xs), *caches[seg.start + p:seg.stop:seg.period])
        for p in range(seg.period)]

    def body(h, group):
        params, layer_caches = group
        reports, written = [], []
        for graph, state, leaves, cache in zip(graphs, params, stacks, layer_caches):
            with fsdp.slices_of(leaves, jax.tree.leaves(state)), remat.scanned_body():
                h, cache, report = step(nnx.merge(graph, state), h, cache)
            reports.append(report)
            written.append(cache)
        return h, (reports, written if caches is not None else None)
    group_caches = stacked if stacked is not None else [None] * seg.period
    x, (reports, written) = jax.lax.scan(body, x, (list(states), group_caches), unroll=unroll)
    return x, reports, written


def _layer_order(seg: Segment) -> list[int]:
    """The layers of a stacked segment by (repeat, position), as ``_unstacked`` lists them."""
    return [seg.start + r * seg.period + p for r in range(seg.repeats) for p in range(seg.period)]


def _unstacked(seg: Segment, written: list | None) -> list:
    """Each layer's cache out of a segment's stacked ones (``_layer_order``); Nones without."""
    if written is None:
        return [None] * (seg.repeats * seg.period)
    return [jax.tree.map(lambda a, r=r: a[r], written[p])
            for r in range(seg.repeats) for p in range(seg.period)]


def per_layer(runs: Sequence[Segment], reports: list) -> list:
    """``run``'s reports one per layer, in order (a scanned segment's cut out of its stacks)."""
    out, given = [], iter(reports)
    for seg in runs:
        group = [next(given) for _ in range(1 if seg.repeats == 1 else seg.period)]
        if seg.repeats == 1:
            out.extend(group)
            continue
        out.extend(jax.tree.map(lambda a, r=r: a[r], group[p])
                   for r in range(seg.repeats) for p in range(seg.period))
    return out


def blocks(modules, runs: Sequence[Segment] | None, call: Callable, x: Any,
           keep: bool = False) -> tuple[Any, list | None]:
    """A vision tower's blocks (``stacked`` when ``runs``, else a list run in a Python loop):
    ``x`` through each by ``call(block, x) -> x``. Returns ``(x, states)``; ``keep``: states
    holds each block's output in order (scanned: the scan's ``ys``, one hidden state a block
    kept), else None."""
    if runs is None:
        states = []
        for block in modules:
            x = call(block, x)
            states.append(x)
        return x, states if keep else None

    def step(block, h, _):
        h = call(block, h)
        return h, None, h if keep else None
    x, _, reports = run(modules, runs, step, x)
    return x, per_layer(runs, reports) if keep else None
