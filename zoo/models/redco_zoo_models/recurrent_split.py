"""Context parallelism for the recurrent token mixers (Gated DeltaNet, Mamba2): each device runs
its own part of the sequence, and the state is passed between devices along it.

The sequence is split in ``context_parallel``'s balanced layout: of ``2k`` chunks, device ``d``
holds chunks ``d`` and ``2k - 1 - d``. A recurrent mixer's output at a token depends on every
earlier token, but only through two things of fixed size: the short convolution's last ``K - 1``
inputs, and the state. And the map from the state entering a chunk to the state leaving it is
affine, ``S_out = T(S_in) + S_local``: ``S_local`` is what the chunk leaves from a zero state,
``T`` what the chunk does to a state it is given (Gated DeltaNet: a ``Dk x Dk`` matrix per head,
the product of its tokens' ``exp(g) (I - beta k k^T)``; Mamba2: a decay per head). So, inside
``shard_map`` over the sequence axis, each device:

1. gathers every chunk's last ``K - 1`` convolution inputs (a few tokens) and convolves each
   of its chunks after the tail of the chunk before it;
2. runs each of its chunks from a zero state (``S_local``) and, on zero writes, from the
   identity (``T``): the mixer's own chunked rule, twice;
3. gathers every chunk's ``(T, S_local)`` and composes them in the sequence's order:
   ``S_in[j] = T[j-1](S_in[j-1]) + S_local[j-1]`` from ``S_in[0] = 0``;
4. runs its chunks once more from their entering states: the outputs.

Each device computes its ``1/k`` of the sequence three times (the mixer's chunked rule is a
small part of a layer) and moves ``2k`` states; no device holds the sequence.

**Packed rows and padding** as unsplit: a chunk's tokens and its tail are one sequence of
documents for the convolution (a token reads no other document's inputs), and a chunk whose
first token starts a new document takes a zero state. With an ``attention_mask``, padding is
a segment of its own in the split layout; here it is one document with the padded tokens
writing nothing (the mixers zero them), as unsplit.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from redco_zoo_models.layers import document_runs


def mixer_inputs(split) -> tuple[Any, Any]:
    """``(valid, segments)`` of a split sequence's local tokens for a recurrent mixer:
    ``valid`` (B, N) the real tokens (None: all), ``segments`` (B, N) its documents."""
    if split.padding:
        return split.segments > 0, jnp.ones_like(split.segments)
    return None, split.segments


def owner(j: int, k: int) -> tuple[int, int]:
    """(device, its chunk 0 or 1) holding the sequence's chunk ``j`` of ``2k``."""
    return (j, 0) if j < k else (2 * k - 1 - j, 1)


def run(split, conv_in, extras, width: int, conv: Callable, rule: Callable,
        transition: Callable, apply: Callable):
    """The mixer's output (B, N, ...) over the split sequence (module docstring).

    ``conv_in`` (B, N, C): the convolution's inputs; ``extras``: a tree of (B, N, ...) per-token
    inputs of the rule; ``width``: the convolution's; ``conv(x, runs)``: the convolution (and its
    activation) of ``x`` (B, L, C); ``rule(x, extras, state, runs)``: ``(out, final state)`` of a
    chunk from ``state`` (None: zeros); ``transition(x, extras, runs)``: the chunk's ``T``;
    ``apply(T, S)``: ``T(S)``."""
    _, segments = mixer_inputs(split)
    axis, k = split.axis, split.mesh.shape[split.axis]
    if conv_in.shape[1] // (2 * k) < width - 1:
        raise ValueError(f"{conv_in.shape[1]} tokens split into {2 * k} chunks of "
                         f"{conv_in.shape[1] // (2 * k)}: a recurrent layer's convolution reads "
                         f"the {width - 1} tokens before each chunk, so each chunk needs at "
                         "least that many. Use longer rows or fewer context shards.")
    seq = P(None, axis)
    body = lambda x, e, s: _local(x, e, s, axis, k, width, conv, rule,  # noqa: E731
                                  transition, apply)
    # (check_vma off: the rules' scans start from constants, zeros or the identity, that vary
    # over the axis once the chunk's tokens enter them)
    return jax.shard_map(body, mesh=split.mesh, in_specs=(seq, seq, seq), out_specs=seq,
                         axis_names={axis}, check_vma=False)(conv_in, extras, segments)


def _local(conv_in, extras, segments, axis, k, width, conv, rule, transition, apply):
    """One device's part of ``run``: its two chunks."""
    c = conv_in.shape[1] // 2
    halves = [jax.tree.map(lambda x, i=i: x[:, i * c:(i + 1) * c], (conv_in, extras, segments))
              for i in (0, 1)]
    tails = _previous(jax.tree.map(lambda x: jnp.stack([x[:, c - width + 1:c], x[:, -width + 1:]]),
                                   (conv_in, segments)), axis, k)
    chunks = []
    for (x, e, s), (tail_x, tail_s) in zip(halves, tails):
        runs = document_runs(s)
        mixed = conv(jnp.concatenate([tail_x, x], 1),
                     document_runs(jnp.concatenate([tail_s, s], 1)))[:, width - 1:]
        chunks.append((mixed, e, runs, s))
    states = [(transition(x, e, runs), rule(x, e, None, runs)[1]) for x, e, runs, _ in chunks]
    firsts_lasts = [(s[:, 0], s[:, -1]) for *_, s in chunks]
    entering = _entering(states, firsts_lasts, axis, k, apply)
    outs = [rule(x, e, state, runs)[0] for (x, e, runs, _), state in zip(chunks, entering)]
    return jnp.concatenate(outs, 1)


def _previous(tails, axis: str, k: int) -> list:
    """For each of this device's two chunks, the tail of the chunk before it in the sequence
    (zeros and segment -1 before the first): ``tails`` is this device's ``(x, segments)``, each
    stacked (2, B, K - 1, ...) over its chunks."""
    every = jax.lax.all_gather(tails, axis)  # (k, 2, B, K - 1, ...)
    d = jax.lax.axis_index(axis)
    before_first = jax.tree.map(lambda x: jnp.where(
        d > 0, x[jnp.maximum(d - 1, 0), 0], jnp.full_like(x[0, 0], 0 if x.dtype.kind == "f"
                                                            else -1)), every)
    # chunk 2k-1-d follows chunk 2k-2-d: device d+1's second, or (d = k-1) its own first
    before_second = jax.tree.map(lambda x: jnp.where(d < k - 1, x[jnp.minimum(d + 1, k - 1), 1],
                                                     x[k - 1, 0]), every)
    return [before_first, before_second]


def _entering(states, firsts_lasts, axis: str, k: int, apply: Callable) -> list:
    """The states entering this device's two chunks: every chunk's ``(T, S_local)`` gathered
    and composed in the sequence's order; a chunk that starts a new document enters at zero."""
    every = jax.lax.all_gather((states, firsts_lasts), axis)  # leaves (k, ...) per chunk
    (trans, local), (first, last) = jax.tree.map(lambda *x: jnp.stack(x, 1), *every[0]), \
        jax.tree.map(lambda *x: jnp.stack(x, 1), *every[1])  # (k, 2, ...)
    entering = [jnp.zeros_like(local[0, 0])]
    for j in range(1, 2 * k):
        (dp, cp), (dj, cj) = owner(j - 1, k), owner(j, k)
        leaving = apply(trans[dp, cp], entering[-1]) + local[dp, cp]
        same = (first[dj, cj] == last[dp, cp]).reshape((-1,) + (1,) * (leaving.ndim - 1))
        entering.append(jnp.where(same, leaving, 0.0))
    ordered = jnp.stack(entering)  # (2k, B, ...)
    d = jax.lax.axis_index(axis)
    return [ordered[d], ordered[2 * k - 1 - d]]
