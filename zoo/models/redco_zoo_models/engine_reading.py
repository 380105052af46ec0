"""How the engine (``redco_zoo_models.engine``) reads prompts: each into its first row from an
offset, a chunk a step (``prefill_chunk``), after a cached prefix (``prefix_cache``) copied in
from another row, all of a step's chunks in one prefill (``engine_steps.prefill_rows``).

A step's prefill (one call) copies each donor row's slots into its reader's row first, then
reads every chunk, then copies each prompt read whole into its other samples' rows. A donor is
never written before its copy: a free donor row is taken by the very request that matched it
(it reads on from its own slots, no copy), a running one is no target, and a row taken for a
prompt leaves the prefix cache at once, so no later match finds it half rewritten. A row whose
chunk starts at slot 0 starts from an empty state; a later chunk continues the state the last
one left (a recurrent layer's, Gated DeltaNet's or Mamba2's, as its keys for attention).
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from redco_zoo_models.requests import Request

MIN_BUCKET = 16  # the shortest prefill shape


def prefill_width(longest: int, max_len: int) -> int:
    """The padded width of a prefill whose longest prompt (chunk) is ``longest`` tokens: a
    power of two, at least ``MIN_BUCKET``, at most ``max_len`` (so that few shapes compile)."""
    return min(max(MIN_BUCKET, 1 << (longest - 1).bit_length()), max_len)


@dataclasses.dataclass(eq=False)
class Reading:
    """A prompt being read into its rows, a chunk a step: ``read`` of its tokens are in its
    first row (after ``donor``'s copy, if one is due, of a cached prefix)."""
    request: Request
    rows: list[int]
    read: int = 0
    donor: int | None = None


def check_reading(slotted, prefill_chunk: int | None, prefix_caching: bool) -> None:
    """Refuse a ``prefill_chunk`` that is no power of two >= ``MIN_BUCKET``, and prefix caching
    on a model with recurrent layers (``slotted``: which cache leaves have a slot axis)."""
    if prefill_chunk is not None and (prefill_chunk < MIN_BUCKET or
                                      prefill_chunk & (prefill_chunk - 1)):
        raise ValueError(f"prefill_chunk={prefill_chunk}: give a power of two >= {MIN_BUCKET} "
                         "(chunks are padded to powers of two), or None to read prompts whole.")
    if prefix_caching and not all(jax.tree.leaves(slotted)):
        raise ValueError("prefix_caching needs a key and value per slot in every layer's cache; "
                         "this model's recurrent layers (Gated DeltaNet, Mamba2) hold one state "
                         "a row, which a prefix's slots cannot restart: leave prefix_caching off "
                         "(chunked prefill works on them).")


def chunk_batch(reading: list[Reading], chunks: list[list[int]], width: int, max_seqs: int):
    """``prefill_rows``' arrays for ``chunks`` (each ``Reading``'s next), ``width`` wide, and the
    readings they end: ``(ids, lengths, starts, rows, copies, n_copies, done)``. The readings
    move on by their chunks, and their donors are spent."""
    ids = np.zeros((1 << (len(chunks) - 1).bit_length(), width), np.int32)
    lengths, starts = np.ones(len(ids), np.int32), np.zeros(len(ids), np.int32)
    rows = np.full(len(ids), max_seqs, np.int32)  # (past the last row: a padding prompt)
    copies, n_copies, done = np.zeros((4, max_seqs), np.int32), np.zeros(2, np.int32), []
    for i, (r, chunk) in enumerate(zip(reading, chunks)):
        ids[i, :len(chunk)], lengths[i], starts[i], rows[i] = chunk, len(chunk), r.read, \
            r.rows[0]
        if r.donor is not None:
            copies[:2, n_copies[0]], r.donor = (r.donor, r.rows[0]), None
            n_copies[0] += 1
        r.read += len(chunk)
        if r.read == len(r.request.prompt):
            done.append(r)
            for row in r.rows[1:]:
                copies[2:, n_copies[1]] = r.rows[0], row
                n_copies[1] += 1
    return ids, lengths, starts, rows, copies, n_copies, done
