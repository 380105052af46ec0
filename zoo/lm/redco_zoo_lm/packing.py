"""Documents packed into rows of equal length, decided once, before training.

A row holds ``seq_len + 1`` tokens (the model reads the first ``seq_len`` and predicts the last
``seq_len``). Documents longer than a row are cut into row-sized pieces; then every piece, the
longest first (ties in an order fixed by ``seed``), goes into the open row with the least room
that still fits it, or opens a new row (best-fit decreasing: on mixed lengths it leaves a few
percent of a row empty at most). A row's pieces carry segment ids 1, 2, ... and the rest is
padding with segment id 0, which the zoo's models and LM loss honour (a document attends only
to itself; predictions across a boundary and of padding are not counted).

Packing works on windows of consecutive documents, ``WINDOW_PIECES`` pieces at most each, one
after another, so its memory is bounded whatever the corpus's size (a corpus of fewer pieces is
one window; packing in windows leaves at most a row or two less full per window). Window ``k``
breaks ties with ``seed`` and ``k``. The plan, a few integers per piece and per row, goes to disk
as it is made (``<file>.rows<width>-seed<seed>/``, ``redco_zoo_lm/disk_arrays.py``, remade when
the file changes), so that a restart does not pack again; ``PackedRows`` is a random-access
sequence of rows that reads a row's few entries of the plan, then its tokens, when a batch needs
it: ``fit`` shuffles, shards across processes and resumes it like any list. Its ``fingerprint``
(the file's documents' lengths and its first and last 4,096 tokens, the row width, the seed,
the number of windows where more than one) goes into every step checkpoint: a resume against a
changed corpus is refused, naming what changed (a change in the middle of the file that keeps
every document's length is not seen).
"""
from __future__ import annotations

import bisect
import os
from typing import Iterator, Sequence

import numpy as np

from redco.data_order import Rows
from redco_zoo_lm.corpus import Progress, TokenFile
from redco_zoo_lm.disk_arrays import ArrayWriter, DiskArray, kept

WINDOW_PIECES = 1 << 18  # pieces packed together at most (about 45 MB while packed)
PLAN_FILES = {"start.i64": np.int64, "length.i32": np.int32, "bounds.i64": np.int64}


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


def windows(corpus: TokenFile, width: int) -> Iterator[tuple[int, int]]:
    """Consecutive ranges of documents of ``WINDOW_PIECES`` pieces at most (a longer
    document: alone)."""
    first = 0
    while first < len(corpus):
        _, lengths = corpus.spans(first, first + WINDOW_PIECES)
        pieces = np.cumsum(-(-lengths // width))
        stop = first + max(int(np.searchsorted(pieces, WINDOW_PIECES, side="right")), 1)
        yield first, stop
        first = stop


def pack_window(starts: np.ndarray, lengths: np.ndarray, width: int, rng: np.random.Generator,
                packed: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(start, length, bounds)`` of documents ``(starts, lengths)``: each piece's first token
    in the corpus and length, row after row; ``bounds[i]``: the first piece of row ``i``. Not
    ``packed``: a piece a row, in the corpus's order."""
    document, offset, length = pieces_of(lengths, width)
    tie_break = rng.permutation(len(length))
    row = best_fit(length, width, np.lexsort((tie_break, -length))) if packed else \
        np.arange(len(length))
    by_row = np.lexsort((tie_break, row))  # each row's pieces together
    return (starts[document[by_row]] + offset[by_row], length[by_row],
            np.searchsorted(row[by_row], np.arange(row.max() + 2)))


def pack(corpus: TokenFile, width: int, seed: int, packed: bool, folder: str) -> dict:
    """Writes the plan (``start.i64``, ``length.i32``, ``bounds.i64``, as ``pack_window``'s)
    of every window into ``folder``; returns its rows, tokens and windows."""
    files = {name.split(".")[0]: ArrayWriter(os.path.join(folder, name), dtype)
             for name, dtype in PLAN_FILES.items()}
    n_pieces = n_tokens = n_windows = 0
    progress = Progress(f"packing {corpus.path} into rows of {width}", len(corpus), "documents")
    for first, stop in windows(corpus, width):
        rng = np.random.default_rng(seed if n_windows == 0 else [seed, n_windows])
        start, length, bounds = pack_window(*corpus.spans(first, stop), width, rng, packed)
        files["start"].write(start)
        files["length"].write(length)
        files["bounds"].write(bounds[:-1] + n_pieces)
        n_pieces, n_tokens, n_windows = n_pieces + len(start), n_tokens + int(length.sum()), \
            n_windows + 1
        progress(stop)
    files["bounds"].write([n_pieces])
    for file in files.values():
        file.close()
    return {"rows": files["bounds"].n - 1, "tokens": n_tokens, "windows": n_windows}


class PackedRows(Sequence):
    """Rows of ``seq_len + 1`` tokens packed from ``corpus``'s documents (module docstring):
    ``rows[i]`` is ``{"token_ids", "segment_ids"}``, each ``(seq_len + 1,)`` int32. Not
    ``packed``: each document (or row-sized piece of one) alone in its row, padded."""

    def __init__(self, corpus: TokenFile, seq_len: int, seed: int = 0, packed: bool = True):
        self.corpus, self.width = corpus, seq_len + 1
        kind = "" if packed else "-unpacked"
        folder, plan = kept(f"{corpus.path}.rows{self.width}{kind}-seed{seed}", corpus.key,
                            lambda into: pack(corpus, self.width, seed, packed, into))
        self.start, self.length, self.bounds = (
            DiskArray(os.path.join(folder, name), dtype) for name, dtype in PLAN_FILES.items())
        self.padding_share = 1 - plan["tokens"] / (len(self) * self.width)
        windows_said = f", packed in {plan['windows']} windows" if plan["windows"] > 1 else ""
        self.fingerprint = (f"{os.path.basename(corpus.path)}: {len(corpus)} documents, "
                            f"{corpus.n_tokens} tokens (sha256 {corpus.documents_sha256[:12]}), "
                            f"rows of {self.width}{kind}, seed {seed}{windows_said}")

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def __getitem__(self, i: int | slice) -> dict | list[dict]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        i %= len(self)
        first, stop = self.bounds[i:i + 2]
        token_ids = np.zeros(self.width, np.int32)
        segment_ids = np.zeros(self.width, np.int32)
        at = 0
        for segment, (start, n) in enumerate(zip(self.start[first:stop].tolist(),
                                                 self.length[first:stop].tolist()), start=1):
            token_ids[at:at + n] = self.corpus.tokens(start, n)
            segment_ids[at:at + n] = segment
            at += n
        return {"token_ids": token_ids, "segment_ids": segment_ids}


class RowsView(Rows):
    """Some rows of ``rows`` (a ``PackedRows``, a mixture...), by index, each read only when
    asked for (core's ``Rows``); ``what`` names which, for the fingerprint."""

    def __init__(self, rows: Sequence, indices: np.ndarray, what: str = "some rows"):
        super().__init__(rows, indices)
        self.fingerprint = f"{what} ({len(indices)}) of {getattr(rows, 'fingerprint', len(rows))}"


class EveryNth(Sequence):
    """Every ``every``-th row of ``rows`` (``held``; at least one: the last where there are
    fewer), or all the others, found by arithmetic: nothing is held per row."""

    def __init__(self, rows: Sequence, every: int, held: bool):
        self.rows, self.every, self.held = rows, every, held
        n_held = max(len(rows) // every, 1)
        self.n = n_held if held else len(rows) - n_held
        what = f"every {every}th row" if held else f"all but every {every}th row"
        self.fingerprint = f"{what} ({self.n}) of {getattr(rows, 'fingerprint', len(rows))}"

    def __len__(self) -> int:
        return self.n

    def index(self, i: int) -> int:
        """Which row of ``rows`` is this one's ``i``-th."""
        if self.held:
            return (i + 1) * self.every - 1 if len(self.rows) >= self.every else len(self.rows) - 1
        return i // (self.every - 1) * self.every + i % (self.every - 1)

    def __getitem__(self, i: int | slice):
        if isinstance(i, slice):
            return Rows(self, np.arange(*i.indices(self.n)))
        if not -self.n <= i < self.n:
            raise IndexError(f"row {i} of {self.n}")
        return self.rows[self.index(i % self.n)]


def hold_out(rows: Sequence, every: int = 20) -> tuple[EveryNth, EveryNth]:
    """``(train, eval)``: every ``every``-th row held out for evaluation (at least one)."""
    return EveryNth(rows, every, held=False), EveryNth(rows, every, held=True)
