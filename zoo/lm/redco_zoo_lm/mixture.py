"""Rows of several corpora as one random-access sequence: one after another (``Concat``: the
token files of a folder), or drawn by weight (``Mixture``).

A mixture decides, once and for a seed, which corpus each of its rows comes from: row ``i``'s
source is a weighted draw, and the ``k``-th row drawn from a source is that source's row ``k``
(modulo its length: a small corpus given a large weight is repeated, a large one given a small
weight is sampled). So ``mixture[i]`` is fixed by the seed and ``i`` alone; ``fit`` shuffles,
shards and resumes it like any sequence, and its ``fingerprint`` (the sources' fingerprints, the
weights, the seed, the length) goes into every step checkpoint: resuming with other weights is
refused. Memory: 5 bytes per row (the source, and the index within it).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from redco.protocols import UsageError


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
        self.source = np.random.default_rng(seed).choice(
            len(self.parts), size=n_rows, p=weights / weights.sum()).astype(np.uint8)
        self.within = np.zeros(n_rows, np.uint32)  # the how-many-th row of its source
        for k in range(len(self.parts)):
            drawn = np.flatnonzero(self.source == k)
            self.within[drawn] = np.arange(len(drawn)) % len(self.parts[k])
        self.fingerprint = (f"{n_rows} rows, seed {seed}, of " + "; ".join(
            f"{w / weights.sum():.4g} x {n} ({getattr(p, 'fingerprint', len(p))})"
            for n, p, w in zip(self.names, self.parts, weights)))

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int):
        return self.parts[int(self.source[i])][int(self.within[i])]

    def shares(self) -> dict[str, float]:
        """Each source's share of the rows."""
        counts = np.bincount(self.source, minlength=len(self.parts))
        return {n: float(c) / len(self) for n, c in zip(self.names, counts)}
