"""Documents packed into rows of equal length, decided once, before training.

A row holds ``seq_len + 1`` tokens (the model reads the first ``seq_len`` and predicts the last
``seq_len``). Documents longer than a row are cut into row-sized pieces; then every piece, the
longest first (ties in an order fixed by ``seed``), goes into the open row with the least room
that still fits it, or opens a new row (best-fit decreasing: on mixed lengths it leaves a few
percent of a row empty at most). A row's pieces carry segment ids 1, 2, ... and the rest is
padding with segment id 0, which the zoo's models and LM loss honour (a document attends only
to itself; predictions across a boundary and of padding are not counted).

The plan is a few integers per piece, kept beside the corpus (``<file>.rows<width>-seed<seed>.npz``,
remade when the file changes) so that a restart does not pack again, and ``PackedRows`` is a
random-access sequence of rows:
``fit`` shuffles, shards across processes and resumes it like any list, and a row is read from
the corpus only when a batch needs it. Its ``fingerprint`` (the file's documents' lengths and
its first and last 4,096 tokens, the row width, the seed) goes into every step checkpoint: a
resume against a changed corpus is refused, naming what changed (a change in the middle of the
file that keeps every document's length is not seen).
"""
from __future__ import annotations

import bisect
import hashlib
import os
from typing import Sequence

import numpy as np

from redco.data_order import Rows
from redco_zoo_lm.corpus import TokenFile, kept_arrays


def pieces_of(lengths: np.ndarray, row: int) -> tuple[np.ndarray, np.ndarray]:
    """``(document, offset, length)`` of every piece, documents cut into pieces of ``row``."""
    n_pieces = -(-lengths // row)
    document = np.repeat(np.arange(len(lengths)), n_pieces)
    first = np.cumsum(n_pieces) - n_pieces
    index = np.arange(len(document)) - np.repeat(first, n_pieces)  # the piece's place in its doc
    offset = index * row
    return document, offset, np.minimum(lengths[document] - offset, row)


def best_fit(lengths: np.ndarray, row: int, order: np.ndarray) -> np.ndarray:
    """The row of each piece (``lengths[i] <= row``), placing pieces in ``order``."""
    rows_with_room: dict[int, list[int]] = {}  # room left -> open rows with exactly that room
    rooms: list[int] = []  # the distinct rooms of open rows, sorted
    placed, n_rows = np.empty(len(lengths), np.int64), 0
    for i in order:
        need = int(lengths[i])
        at = bisect.bisect_left(rooms, need)
        if at < len(rooms):
            room = rooms[at]
            r = rows_with_room[room].pop()
            if not rows_with_room[room]:
                del rows_with_room[room], rooms[at]
        else:
            room, r, n_rows = row, n_rows, n_rows + 1
        placed[i] = r
        left = room - need
        if left:
            if left not in rows_with_room:
                rows_with_room[left] = []
                bisect.insort(rooms, left)
            rows_with_room[left].append(r)
    return placed


def pack(corpus: TokenFile, width: int, seed: int, packed: bool = True) -> dict:
    """Each piece's first token in the corpus and length, row after row; ``bounds[i]``: the
    first piece of row ``i``. Not ``packed``: a piece a row, in the corpus's order."""
    document, offset, length = pieces_of(corpus.lengths, width)
    tie_break = np.random.default_rng(seed).permutation(len(length))
    row = best_fit(length, width, np.lexsort((tie_break, -length))) if packed else \
        np.arange(len(length))
    by_row = np.lexsort((tie_break, row))  # each row's pieces together
    return {"start": corpus.starts[document[by_row]] + offset[by_row],
            "length": length[by_row],
            "bounds": np.searchsorted(row[by_row], np.arange(row.max() + 2))}


class PackedRows(Sequence):
    """Rows of ``seq_len + 1`` tokens packed from ``corpus``'s documents (module docstring):
    ``rows[i]`` is ``{"token_ids", "segment_ids"}``, each ``(seq_len + 1,)`` int32. Not
    ``packed``: each document (or row-sized piece of one) alone in its row, padded."""

    def __init__(self, corpus: TokenFile, seq_len: int, seed: int = 0, packed: bool = True):
        self.corpus, self.width = corpus, seq_len + 1
        kind = "" if packed else "-unpacked"
        plan = kept_arrays(f"{corpus.path}.rows{self.width}{kind}-seed{seed}.npz", corpus.key,
                           lambda: pack(corpus, self.width, seed, packed))
        self.start, self.length, self.bounds = plan["start"], plan["length"], plan["bounds"]
        self.padding_share = 1 - self.length.sum() / (len(self) * self.width)
        digest = hashlib.sha256(corpus.lengths.tobytes())  # and its first and last tokens:
        digest.update(corpus.key["ends_sha256"].encode())
        self.fingerprint = (f"{os.path.basename(corpus.path)}: {len(corpus)} documents, "
                            f"{corpus.n_tokens} tokens (sha256 {digest.hexdigest()[:12]}), rows "
                            f"of {self.width}{kind}, seed {seed}")  # saved with step checkpoints

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def __getitem__(self, i: int | slice) -> dict | list[dict]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        i %= len(self)
        token_ids = np.zeros(self.width, np.int32)
        segment_ids = np.zeros(self.width, np.int32)
        at = 0
        for segment, piece in enumerate(range(self.bounds[i], self.bounds[i + 1]), start=1):
            n = int(self.length[piece])
            token_ids[at:at + n] = self.corpus.tokens(int(self.start[piece]), n)
            segment_ids[at:at + n] = segment
            at += n
        return {"token_ids": token_ids, "segment_ids": segment_ids}


class RowsView(Rows):
    """Some rows of ``rows`` (a ``PackedRows``, a mixture...), by index, each read only when
    asked for (core's ``Rows``); ``what`` names which, for the fingerprint."""

    def __init__(self, rows: Sequence, indices: np.ndarray, what: str = "some rows"):
        super().__init__(rows, indices)
        self.fingerprint = f"{what} ({len(indices)}) of {getattr(rows, 'fingerprint', len(rows))}"


def hold_out(rows: Sequence, every: int = 20) -> tuple[RowsView, RowsView]:
    """``(train, eval)``: every ``every``-th row held out for evaluation (at least one)."""
    held = np.arange(len(rows)) % every == every - 1
    if not held.any():
        held[-1] = True
    return (RowsView(rows, np.flatnonzero(~held), f"all but every {every}th row"),
            RowsView(rows, np.flatnonzero(held), f"every {every}th row"))
