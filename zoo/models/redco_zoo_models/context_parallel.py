"""Attention over a sequence split across devices (context parallelism), exact.

The sequence axis of a batch is split over a mesh axis (``cp``, k devices). Causal attention
makes the split uneven: the device holding the last tokens attends to everything, the first
to almost nothing. ``balance`` fixes that once, where the batch is laid out: the sequence is cut
into 2k chunks and device i holds chunks i and 2k-1-i (one early, one late), so every device
has the same share of the causal mask's work; ``unbalance`` puts outputs that need order back.
Each token carries its position in the row and its segment id (packed documents), so the mask
is computed from them and the layout never changes the result.

Two strategies, run inside ``shard_map`` over the axis (``attend_split``):

* ``all_gather``: each device gathers every device's keys and values (and their positions and
  segments) and attends its queries to the whole sequence: simple, exact, K/V of the whole
  sequence per layer in memory (MaxText's default).
* ``ring``: keys and values go round the devices with ``ppermute``, one block per step; each
  step attends the local queries to the block at hand and folds the result in by its
  log-sum-exp (``tiled_attention.merge``). The same bytes move as with all-gather, as k-1
  permutes that XLA can overlap with each step's compute.

Either way a device's attention runs in tiles of keys with a recomputing backward pass
(``redco_zoo_models.tiled_attention``, flash attention's algorithm): its scores are never more
than (local tokens x one tile) per head, so the activation memory per device falls ~1/k.

In a model (the zoo's LLaMA family), ``split_inputs`` lays a decoder's inputs out once, when
``redco.sequence_split.current()`` says the sequence is split: token ids, RoPE positions and
segment ids in the balanced order (the ids are replicated over the axis, so nothing moves), and a
``SplitSequence`` that each layer's attention runs through in place of a mask. Norms, MLPs and
embeddings run on the local tokens; the final hidden states are put back in order
(``unbalance``) before the output head, so the loss sees the sequence as it was.

Generation (``redco_zoo_models.generation`` under a ``Predictor``): a prompt read into an empty
cache is laid out the same way, its left padding a segment of its own; its keys and values go
into the cache in order, and the cache's slots stay split over the axis (``cached_keys``), so a
generated token's attention reads each device's share of the cache where it lies.

``sequence_parallel_attention`` wraps either strategy for arrays laid out in order (tests):
balance, ``shard_map``, unbalance.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import flax
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from redco import sequence_split
from redco_zoo_models.attention import (
    attend,
    decoder_inputs,
    positions_from,
    segment_positions,
    within_window,
    write_cache,
)
from redco_zoo_models.tiled_attention import merge, tiled_attention, with_sinks


def check_length(n: int, k: int) -> None:
    """Refuse a sequence that does not split into ``2k`` equal chunks."""
    if n % (2 * k):
        raise ValueError(f"A sequence of {n} tokens does not split into 2 x {k} equal chunks "
                         f"for {k}-way context parallelism with causal load balancing: pad the "
                         f"rows to a multiple of {2 * k} tokens or change the context degree.")


def balanced_order(n: int, k: int) -> jnp.ndarray:
    """The token order whose k contiguous parts are chunks ``(i, 2k-1-i)`` of ``n`` tokens."""
    check_length(n, k)
    c = n // (2 * k)
    chunks = [j for i in range(k) for j in (i, 2 * k - 1 - i)]
    return jnp.concatenate([jnp.arange(j * c, (j + 1) * c) for j in chunks])


def balance(x, k: int, axis: int = 1):
    """``x`` with its sequence ``axis`` in the load-balanced order (``balanced_order``)."""
    return jnp.take(x, balanced_order(x.shape[axis], k), axis=axis)


def unbalance(x, k: int, axis: int = 1):
    """``balance`` undone: the sequence back in order."""
    return jnp.take(x, jnp.argsort(balanced_order(x.shape[axis], k)), axis=axis)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def gather_sequence(x, axis: str):
    """Every device's ``x`` (B, T, ...) along the sequence, inside ``shard_map`` over ``axis``.
    Its gradient is reduce-scattered in fp32 (then cast back): low-precision K/V gradients from
    k devices are summed without rounding at each addition, and XLA's CPU compiler (jax 0.10)
    crashes on a bf16 reduce-scatter in a ``shard_map`` manual over some mesh axes only."""
    return jax.lax.all_gather(x, axis, axis=1, tiled=True)


def _gather_forward(x, axis: str):
    return gather_sequence(x, axis), None


def _gather_backward(axis: str, _, grad):
    summed = jax.lax.psum_scatter(grad.astype(jnp.float32), axis, scatter_dimension=1, tiled=True)
    return (summed.astype(grad.dtype),)


gather_sequence.defvjp(_gather_forward, _gather_backward)


def attend_split(q, k, v, q_pos, k_pos, q_seg, k_seg, axis: str, strategy: str = "all_gather",
                 scale: float | None = None, window: int | None = None,
                 softcap: float | None = None, sinks=None):
    """This device's queries (B, T, H, D) attended to the keys and values of every device on
    mesh ``axis``; call inside ``shard_map``. ``*_pos``, ``*_seg``: (B, T) positions in the row
    and segment ids of the local tokens. Each device's share runs in tiles
    (``redco_zoo_models.tiled_attention``): its scores never exceed (T, tile) per head. A
    sliding ``window`` counts in those row positions; ``softcap`` caps the scores (Gemma);
    ``sinks`` (H,) join every softmax (gpt-oss: ``tiled_attention.with_sinks`` of the whole
    sequence's log-sum-exp)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    attention = partial(tiled_attention, scale=scale, window=window, softcap=softcap)
    if strategy == "all_gather":
        gather = partial(jax.lax.all_gather, axis_name=axis, axis=1, tiled=True)
        k, v = gather_sequence(k, axis), gather_sequence(v, axis)
        return with_sinks(*attention(q, k, v, q_pos, gather(k_pos), q_seg, gather(k_seg)),
                          sinks)
    if strategy != "ring":
        raise ValueError(f"strategy {strategy!r}: choose one of {sequence_split.STRATEGIES}.")
    n = jax.lax.psum(1, axis)
    to_next = [(i, (i + 1) % n) for i in range(n)]
    block = (k, v, k_pos, k_seg)
    acc = attention(q, k, v, q_pos, k_pos, q_seg, k_seg)
    for _ in range(n - 1):  # (unrolled: k is small and static; XLA overlaps the permutes)
        block = jax.tree.map(lambda x: jax.lax.ppermute(x, axis, to_next), block)
        kb, vb, pb, sb = block
        acc = merge(acc, attention(q, kb, vb, q_pos, pb, q_seg, sb))
    return with_sinks(*acc, sinks).astype(q.dtype)


@flax.struct.dataclass
class SplitSequence:
    """A split sequence, as a decoder layer's ``allowed`` argument: each local token's place in
    its row (``row_positions``, for the causal mask) and segment id; ``attend`` runs
    ``attend_split`` over the mesh ``axis``."""
    row_positions: jax.Array
    segments: jax.Array
    mesh: Any = flax.struct.field(pytree_node=False)
    axis: str = flax.struct.field(pytree_node=False)
    strategy: str = flax.struct.field(pytree_node=False)
    padding: bool = flax.struct.field(pytree_node=False, default=False)  # segments: 1 real, 0 pad

    def attend(self, q, k, v, scale: float | None = None, window: int | None = None,
               softcap: float | None = None, sinks=None):
        """``attend_split`` of the local tokens (a sliding ``window`` over their row positions,
        ``softcap`` on the scores, each head's ``sinks``), inside ``shard_map`` over the axis."""
        seq, given = P(None, self.axis), () if sinks is None else (sinks,)
        run = jax.shard_map(
            lambda q, k, v, pos, seg, *sink: attend_split(
                q, k, v, pos, pos, seg, seg, self.axis, self.strategy, scale, window, softcap,
                *sink),
            mesh=self.mesh, in_specs=(seq,) * 5 + (P(),) * len(given), out_specs=seq,
            axis_names={self.axis})
        return run(q, k, v, self.row_positions, self.segments, *given)

    def split(self, x):
        """``x`` (B, N, ...) constrained to the local tokens' devices (other dims as XLA likes)."""
        spec = P(P.UNCONSTRAINED, self.axis, *[P.UNCONSTRAINED] * (x.ndim - 2))
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    def in_order(self, x):
        """``x`` (B, N, ...) back in the sequence's order, still split over the devices (in
        order now: device i holds the i-th k-th of the sequence), so the output head and the
        loss run on each device's own tokens, not on the whole sequence everywhere."""
        return self.split(unbalance(x, self.mesh.shape[self.axis]))


def decoder_layout(input_ids, attention_mask=None, cached: bool = False, cache_index=0,
                   segment_ids=None) -> tuple:
    """``(ids, positions, allowed)`` of a decoder's input: ``attention.decoder_inputs``'s, or,
    while ``redco.sequence_split`` splits the sequence, the ids and positions in the balanced
    order and a ``SplitSequence`` as ``allowed``: in training, and for a prompt read into an
    empty cache (``cache_index`` 0). An ``attention_mask``'s padding becomes a segment of its
    own: the real tokens see what they see unsplit (the padding's own outputs, which a loss
    leaves out, differ). Single generated tokens are not split: their cache is
    (``cached_keys``)."""
    split, n = sequence_split.current(), input_ids.shape[1]
    prompt = cached and isinstance(cache_index, int) and cache_index == 0 and n > 1
    if split is None or (cached and not prompt) or \
            (attention_mask is not None and segment_ids is not None):
        return (input_ids, *decoder_inputs(*input_ids.shape, attention_mask, cached, cache_index,
                                           segment_ids))
    if attention_mask is None and not cached:
        return split_inputs(input_ids, segment_ids, split)
    valid = jnp.ones(input_ids.shape, bool) if attention_mask is None else \
        attention_mask[:, :n] > 0
    return split_inputs(input_ids, valid.astype(jnp.int32), split, positions_from(valid),
                        padding=True)


def cache_slots(n: int) -> int:
    """``n`` key/value cache slots, rounded up to split evenly over the devices while the
    sequence is split (``cached_keys`` splits the cache's slots)."""
    split = sequence_split.current()
    k = 1 if split is None else split[0].shape[split[1]]
    return -(-n // k) * k


def cached_keys(layer_cache, k, v, cache_index, allowed):
    """``attention.write_cache``'s ``(keys, values, cache)`` (``v`` None: keys only) under
    context parallelism too: a split prompt writes its keys and values into the cache in the
    sequence's order and attends them as laid out; while the sequence is split, the cache's
    slots are split over the same devices (each holds 1/k of it), and a generated token's
    attention reads them there."""
    split = sequence_split.current() if layer_cache is not None else None
    if split is None:
        return write_cache(layer_cache, k, v, cache_index)
    laid_out = isinstance(allowed, SplitSequence)
    ordered = jax.tree.map(allowed.in_order, (k, v)) if laid_out else (k, v)  # (v None: kept)
    mesh, axis, _ = split
    spec = NamedSharding(mesh, P(P.UNCONSTRAINED, axis, P.UNCONSTRAINED, P.UNCONSTRAINED))
    layer_cache = jax.lax.with_sharding_constraint(write_cache(layer_cache, *ordered,
                                                               cache_index)[2], spec)
    return (k, v, layer_cache) if laid_out else \
        (layer_cache["k"], layer_cache.get("v"), layer_cache)


def attend_laid_out(q, k, v, allowed, window: int | None, cache_index=0, **options):
    """A decoder layer's attention as ``decoder_layout`` laid its tokens out: over a split
    sequence, plain causal (``allowed`` None), or by the mask ``allowed`` (its ``window``
    applied); ``options``: ``attend``'s ``scale``, ``softcap``, ``sinks`` and ``chunk``."""
    if isinstance(allowed, SplitSequence):
        return allowed.attend(q, k, v, window=window, **options)
    if allowed is None:
        return attend(q, k, v, is_causal=True, window=window, **options)
    return attend(q, k, v, within_window(allowed, window, cache_index), **options)


def on_split(x, allowed):
    """``x`` (B, N, ...) on its tokens' devices when the sequence is split, else as it is."""
    return allowed.split(x) if isinstance(allowed, SplitSequence) else x


def in_order(x, allowed):
    """``x`` (B, N, ...) back in the sequence's order when the sequence is split."""
    return allowed.in_order(x) if isinstance(allowed, SplitSequence) else x


def split_inputs(input_ids, segment_ids, split: tuple, positions=None,
                 padding: bool = False) -> tuple:
    """``(ids, positions, SplitSequence)``: a decoder's token ids and positions (restarting at
    each segment, unless given) in the balanced order, for the split ``(mesh, axis,
    strategy)`` that ``redco.sequence_split.current()`` gave; ``padding``: the segment ids
    mark real tokens (1) and padding (0)."""
    mesh, axis, strategy = split
    k, (b, n) = mesh.shape[axis], input_ids.shape
    check_length(n, k)
    rows = jnp.broadcast_to(jnp.arange(n), (b, n))
    segments = jnp.ones((b, n), jnp.int32) if segment_ids is None else segment_ids
    if positions is None:
        positions = rows if segment_ids is None else segment_positions(segment_ids)
    ids, positions, rows, segments = (balance(x, k) for x in (input_ids, positions, rows,
                                                               segments))
    return ids, positions, SplitSequence(rows, segments, mesh, axis, strategy, padding)


def sequence_parallel_attention(q, k, v, segment_ids, mesh, axis: str = "cp",
                                strategy: str = "all_gather", window: int | None = None,
                                softcap: float | None = None):
    """Causal attention of ``q`` (B, N, H, D) to ``k``, ``v`` (B, N, KV, D) within the
    ``segment_ids`` (B, N) of packed rows (a sliding ``window``, capped scores: ``softcap``),
    the sequence split over mesh ``axis`` in the balanced layout; returns (B, N, H, D) in order,
    equal to unsplit attention."""
    k_degree, n = mesh.shape[axis], q.shape[1]
    positions = jnp.broadcast_to(jnp.arange(n), segment_ids.shape)
    laid_out = [balance(x, k_degree) for x in (q, k, v, positions, segment_ids)]
    seq = P(None, axis)
    run = jax.shard_map(lambda q, k, v, pos, seg: attend_split(q, k, v, pos, pos, seg, seg, axis,
                                                               strategy, None, window, softcap),
                        mesh=mesh, in_specs=(seq,) * 5, out_specs=seq)
    return unbalance(run(*laid_out), k_degree)
