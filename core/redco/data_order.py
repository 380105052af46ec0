"""Which examples each update trains on, and where a run stands in its data.

**Sized data** (a random-access sequence, or Redco 0.4's function of the epoch) is read in a
shuffled order that is a function of the seed and the epoch only
(``Deployer.epoch_permutation``): an update takes the next ``examples_per_step`` examples of
that order, and each process reads only its own share of them (``Rows``), so a corpus on disk is
read once across all hosts, not once per host.

**A stream** (an iterator: no length; e.g. a Grain ``DatasetIterator``) is read in its own
order, ``examples_per_step`` at a time, whole by every process (which keeps its rows), so every
process must iterate the same stream. ``fit`` trains on it for ``max_steps`` updates.

**The position** is ``{"epoch", "examples"}``: how many examples of that epoch's order are
trained on (all of them once the epoch has ended), and, for a stream, its iterator's
``get_state()``. ``fit`` saves it with every step checkpoint and continues from it on resume.
It depends on neither the batch size nor the number of processes: a run resumed with either
changed continues at the same example, repeating and skipping none. What the batch size does
decide is which examples are left out at each epoch's end (those that do not fill an update),
and the updates the learning-rate schedule counts.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any, Callable

import numpy as np

from redco.protocols import UsageError


def is_stream(examples: Any) -> bool:
    """Training data with no length that is not a function of the epoch: an iterator."""
    return isinstance(examples, Stream) or (not hasattr(examples, "__len__") and
                                            not callable(examples) and hasattr(examples, "__iter__"))


def as_stream(examples: Any) -> Any:
    """``examples``, an iterator wrapped as a ``Stream`` (once)."""
    return Stream(examples) if is_stream(examples) and not isinstance(examples, Stream) \
        else examples


class Rows(Sequence):
    """``examples[i] for i in indices``, each read only when asked for."""

    def __init__(self, examples: Sequence, indices: np.ndarray):
        self.examples, self.indices = examples, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return Rows(self.examples, self.indices[i])
        return self.examples[int(self.indices[i])]


class Stream:
    """An iterator of examples whose first ones can be looked at before training
    (``peek``) and are then trained on all the same; its position is its ``get_state()``."""

    def __init__(self, iterator: Any):
        self.iterator, self._peeked = iter(iterator), []
        self.saves_state = all(hasattr(self.iterator, m) for m in ("get_state", "set_state"))

    def peek(self, n: int) -> list:
        self._peeked += itertools.islice(self.iterator, n - len(self._peeked))
        if len(self._peeked) < n:
            raise UsageError(f"The training stream ended after {len(self._peeked)} examples; "
                             f"one device's batch needs {n}.")
        return self._peeked[:n]

    def take(self, n: int) -> list:
        """The next ``n`` examples, or fewer where the stream ends."""
        rows, self._peeked = self._peeked[:n], self._peeked[n:]
        return rows + list(itertools.islice(self.iterator, n - len(rows)))

    def get_state(self) -> Any:
        return self.iterator.get_state() if self.saves_state and not self._peeked else None

    def set_state(self, state: Any) -> None:
        self.iterator.set_state(state)
        self._peeked = []


class EpochBatches:
    """The updates of one epoch from ``position`` (examples of its order trained on): each is
    the ``Rows`` (a stream: the list) of examples it trains on; ``position`` after each."""

    def __init__(self, examples: Sequence | Stream, examples_per_step: int,
                 permutation: Callable[[int], np.ndarray] | None, position: int = 0):
        self.examples, self.size, self.position = examples, examples_per_step, position
        self.start = position // examples_per_step  # (for display: the updates before)
        if isinstance(examples, Stream):
            self.n_steps, self.order = None, None
        else:
            self.order = permutation(len(examples))
            self.n_steps = self.start + (len(examples) - position) // examples_per_step

    def end(self, max_updates: int | None) -> int | None:
        """The update (counted in the epoch) to stop before: the epoch's end, or ``start +
        max_updates`` if sooner; None for a stream without ``max_updates`` (to its end)."""
        limits = [n for n in (self.n_steps, None if max_updates is None else
                              self.start + max_updates) if n is not None]
        return min(limits) if limits else None

    def indices(self, end: int | None) -> Iterator[int]:
        """The updates' indices in the epoch, from ``start`` to ``end`` (None: without end)."""
        return itertools.count(self.start) if end is None else iter(range(self.start, end))

    def __iter__(self) -> Iterator[Sequence]:
        while True:
            if self.order is None:
                batch = self.examples.take(self.size)
                if len(batch) < self.size:
                    return
            elif self.position + self.size > len(self.order):
                return
            else:
                batch = Rows(self.examples, self.order[self.position:self.position + self.size])
            self.position += self.size
            yield batch

    def state(self, epoch: int) -> dict:
        """Where training stands: the position a step checkpoint saves (once no full update is
        left in the epoch, all of its examples)."""
        if self.order is None:
            return {"epoch": epoch, "examples": self.position,
                    "stream": self.examples.get_state()}
        ended = self.position + self.size > len(self.order)
        return {"epoch": epoch, "examples": len(self.order) if ended else self.position}


def position_of(meta: dict, n_examples: int | None) -> dict:
    """The position a step checkpoint's ``meta`` saved; for one written before positions were
    (redco <= 0.7), worked out from its step, as those runs did: epochs of equal length."""
    data = meta.get("data", {})
    if "position" in data:
        return data["position"]
    per_step = data.get("examples_per_step")
    if not per_step or not n_examples:
        return {"epoch": meta.get("epoch", 0), "examples": 0}
    steps_per_epoch = n_examples // per_step
    epoch, in_epoch = divmod(meta["step"], steps_per_epoch)
    if in_epoch == 0 and epoch:  # saved at an epoch's end
        return {"epoch": epoch - 1, "examples": n_examples}
    return {"epoch": epoch, "examples": in_epoch * per_step}
