"""An epoch's shuffled order of ``n`` examples, held in memory or computed a slice at a time.

Up to ``IN_MEMORY`` examples the order is numpy's ``permutation`` of them (8 bytes an example).
Above that, a corpus of millions of rows would hold hundreds of megabytes for it on every host,
so the order is a keyed bijection of ``[0, n)``, computed for just the slice an update asks for:
a Feistel network (``ROUNDS`` rounds, each mixing one half of an index's bits with a
splitmix64 hash of the other half under a round key drawn from the seed) permutes
``[0, 4^h)``, the smallest power of four at least ``n``, and an index it sends beyond ``n`` is
sent on again until it lands inside ("cycle walking"), which keeps it a bijection of
``[0, n)``. Grain's ``index_shuffle`` and Levanter's ``FeistelPermutation`` shuffle corpora the
same way. Either order is a function of the seed and the epoch only; which one a run used is
saved with its step checkpoints (``SHUFFLE``), so a resume under the other is refused, not
trained on other examples.
"""
from __future__ import annotations

import numpy as np

IN_MEMORY = 1 << 20  # examples: above this, the order is computed by slices (8 MB held)
ROUNDS = 6
SHUFFLE = "feistel"  # a run's step checkpoints say so where its order was a FeistelOrder


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray | FeistelOrder:
    """The order of ``epoch``: an array, or a ``FeistelOrder`` above ``IN_MEMORY`` examples."""
    if n <= IN_MEMORY:
        return np.random.default_rng([seed, epoch]).permutation(n)
    return FeistelOrder(n, seed, epoch)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """A 64-bit mix of each element (uint64 arithmetic wraps)."""
    x = (x + np.uint64(0x9E3779B97F4A7C15)) & np.uint64(2**64 - 1)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class FeistelOrder:
    """A shuffled order of ``n`` examples for ``seed`` and ``epoch`` (module docstring):
    ``len()``, ``[i]`` and ``[a:b]`` (an int64 array), computed when asked for."""

    def __init__(self, n: int, seed: int, epoch: int):
        self.n = n
        self.half = max((int(n - 1).bit_length() + 1) // 2, 1)  # bits of each half
        self.keys = np.random.default_rng([seed, epoch, 0xFE15]).integers(
            0, 2**63, ROUNDS, dtype=np.uint64)

    def __len__(self) -> int:
        return self.n

    def _round_trip(self, x: np.ndarray) -> np.ndarray:
        """The Feistel network on ``[0, 4^half)``."""
        half, mask = np.uint64(self.half), np.uint64((1 << self.half) - 1)
        left, right = x >> half, x & mask
        for key in self.keys:
            left, right = right, left ^ (splitmix64(right ^ key) & mask)
        return (left << half) | right

    def positions(self, positions: np.ndarray) -> np.ndarray:
        """The examples at ``positions`` of the order."""
        x = self._round_trip(np.asarray(positions, np.uint64))
        outside = x >= self.n
        while outside.any():  # cycle walking: at most a few rounds (4^half < 4n)
            x[outside] = self._round_trip(x[outside])
            outside = x >= self.n
        return x.astype(np.int64)

    def __getitem__(self, i: int | slice):
        if isinstance(i, slice):
            return self.positions(np.arange(*i.indices(self.n), dtype=np.uint64))
        if not -self.n <= i < self.n:
            raise IndexError(f"position {i} of {self.n}")
        return int(self.positions(np.array([i % self.n]))[0])
