"""Rows of several corpora as one random-access sequence: one after another (``Concat``: the
token files of a folder), or drawn by weight (``Mixture``).

A mixture decides, once and for a seed, which corpus each of its rows comes from: row ``i``'s
source is a weighted draw, and the ``k``-th row drawn from a source is that source's row ``k``
(modulo its length: a small corpus given a large weight is repeated, a large one given a small
weight is sampled). So ``mixture[i]`` is fixed by the seed and ``i`` alone; ``fit`` shuffles,
shards and resumes it like any sequence, and its ``fingerprint`` (the sources' fingerprints, the
weights, the seed, the length) goes into every step checkpoint: resuming with other weights is
refused.

Memory does not grow with the corpus. Up to ``IN_MEMORY`` rows the draws are made at once and
kept (5 bytes a row: the source, and the index within it; 6 with more than 256 sources). Above
it (a mixture of token files of many GB) they are made a block of ``BLOCK`` rows at a time,
each block's from the seed and the block's number alone, again whenever a row of it is read (a
few microseconds); what is kept is how many rows each source gave the blocks before each block
(8 bytes per block and source), so row ``i``'s index within its source is that count plus the
draws of its block before it. The fingerprint says which way the rows were drawn.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from redco.protocols import UsageError

IN_MEMORY = 1 << 20  # rows: above this, the draws are made a block at a time
BLOCK = 1 << 12  # rows a block


class Concat(Sequence):
    """``parts`` one after another."""

    def __init__(self, parts: Sequence[Sequence]):
        self.parts = list(parts)
        self.ends = np.cumsum([len(p) for p in self.parts])
        self.fingerprint = " + ".join(str(getattr(p, "fingerprint", len(p))) for p in self.parts)

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def __getitem__(self, i: int):
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        i %= len(self)
        part = int(np.searchsorted(self.ends, i, side="right"))
        return self.parts[part][i - (int(self.ends[part - 1]) if part else 0)]


class Mixture(Sequence):
    """``n_rows`` rows (default: as many as the sources hold together), each from one of
    ``sources`` (``{name: (rows, weight)}``), drawn by weight for ``seed`` (module docstring)."""

    def __init__(self, sources: dict[str, tuple[Sequence, float]], seed: int = 0,
                 n_rows: int | None = None):
        if not sources:
            raise UsageError("A mixture needs at least one source.")
        self.names = sorted(sources)
        self.parts = [sources[n][0] for n in self.names]
        weights = np.array([float(sources[n][1]) for n in self.names])
        for name, part, weight in zip(self.names, self.parts, weights):
            if not weight > 0 or len(part) == 0:
                raise UsageError(f"Mixture source {name}: weight {weight} and {len(part)} rows; "
                                 "give each source a positive weight and at least one row.")
        n_rows = n_rows or sum(len(p) for p in self.parts)
        lengths, p = [len(part) for part in self.parts], weights / weights.sum()
        self.draws = (Draws(n_rows, p, seed, lengths) if n_rows <= IN_MEMORY else
                      BlockDraws(n_rows, p, seed, lengths))
        self.fingerprint = (f"{n_rows} rows, seed {seed}{self.draws.how}, of " + "; ".join(
            f"{w:.4g} x {n} ({getattr(part, 'fingerprint', len(part))})"
            for n, part, w in zip(self.names, self.parts, p)))

    def __len__(self) -> int:
        return self.draws.n_rows

    def __getitem__(self, i: int):
        source, within = self.draws[i]
        return self.parts[source][within]

    def shares(self) -> dict[str, float]:
        """Each source's share of the rows."""
        return {n: float(c) / len(self) for n, c in zip(self.names, self.draws.counts)}


class Draws:
    """Every row's source and its index within it, drawn at once and kept."""
    how = ""

    def __init__(self, n_rows: int, p: np.ndarray, seed: int, lengths: list[int]):
        self.n_rows = n_rows
        self.source = np.random.default_rng(seed).choice(len(p), size=n_rows, p=p).astype(
            np.min_scalar_type(len(p) - 1))  # (a byte holds 256 sources' numbers)
        self.within = np.zeros(n_rows, np.uint32)  # the how-many-th row of its source
        for k, length in enumerate(lengths):
            drawn = np.flatnonzero(self.source == k)
            self.within[drawn] = np.arange(len(drawn)) % length
        self.counts = np.bincount(self.source, minlength=len(p))

    def __getitem__(self, i: int) -> tuple[int, int]:
        return int(self.source[i]), int(self.within[i])


class BlockDraws:
    """The same, made a block of ``BLOCK`` rows at a time when read (module docstring)."""

    def __init__(self, n_rows: int, p: np.ndarray, seed: int, lengths: list[int]):
        self.n_rows, self.p, self.seed, self.lengths = n_rows, p, seed, lengths
        self.size, self.last = BLOCK, (-1, None)
        self.how = f", drawn by blocks of {self.size}"
        per_block = np.zeros((-(-n_rows // self.size), len(p)), np.int64)
        for b in range(len(per_block)):
            per_block[b] = np.bincount(self.block(b), minlength=len(p))
        self.before = np.cumsum(per_block, axis=0) - per_block  # each source's rows before
        self.counts = per_block.sum(axis=0)

    def block(self, b: int) -> np.ndarray:
        """Block ``b``'s sources (the last block made is kept: rows are often read in order)."""
        if self.last[0] != b:
            size = min(self.size, self.n_rows - b * self.size)
            self.last = (b, np.random.default_rng([self.seed, b]).choice(len(self.p), size=size,
                                                                          p=self.p))
        return self.last[1]

    def __getitem__(self, i: int) -> tuple[int, int]:
        if not -self.n_rows <= i < self.n_rows:
            raise IndexError(f"row {i} of {self.n_rows}")
        b, j = divmod(i % self.n_rows, self.size)
        draws = self.block(b)
        k = int(draws[j])
        nth = int(self.before[b, k]) + int(np.count_nonzero(draws[:j] == k))
        return k, nth % self.lengths[k]
