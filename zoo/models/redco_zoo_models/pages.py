"""The host side of the engine's paged key/value cache (``Engine(page_size=...)``): which pages
of one pool each row (a running sequence) holds, and which are free.

The pool holds ``n_pages`` pages of ``page_size`` slots, in every attention layer alike (page
``p`` of every layer belongs to the same sequence). A row's page table lists its pages in slot
order: slot ``s`` of the row lies in page ``table[row, s // page_size]`` at offset
``s % page_size``; an entry ``n_pages`` (past the pool) is no page: reading it gives zeros,
writing it is dropped (``engine_paged``).

**Admission by pages, reserved at admission.** A request of prompt length ``L``, ``max_tokens``
``T`` and ``n`` samples is admitted when the pages it may ever hold fit beside what is held and
promised: its prompt's whole pages once (its samples share them: reference counts) and each
sample's pages from there to slot ``L + T``. The prompt's pages are taken at once (the samples
after the first take a copy of the prompt's last, partly filled page, which each writes on); the
rest are taken as the sequence grows, before each decode step, out of that reservation, so a
sequence never runs out of pages mid-decode and nothing is preempted. A sequence that ends early
(an end token) gives back its pages and what remained of its reservation. A page is free again
when no row holds it (its count falls to 0).
"""
from __future__ import annotations

import jax
import numpy as np


def pages_of(n_slots: int, page_size: int) -> int:
    """Pages that ``n_slots`` slots take."""
    return -(-n_slots // page_size)


class Pages:
    """Page tables of ``max_seqs`` rows of up to ``max_len`` slots over a pool of ``n_pages``
    pages of ``page_size`` slots (module docstring)."""

    def __init__(self, n_pages: int, page_size: int, max_seqs: int, max_len: int):
        self.n_pages, self.size = n_pages, page_size
        self.table = np.full((max_seqs, pages_of(max_len, page_size)), n_pages, np.int32)
        self.refs = np.zeros(n_pages, np.int32)  # rows holding each page
        self.free = list(range(n_pages - 1, -1, -1))  # (taken from the end: lowest first)
        self.limit = np.zeros(max_seqs, np.int32)  # pages each row may hold (held + reserved)

    def available(self) -> int:
        """Free pages that no running row has reserved."""
        reserved = int(self.limit.sum()) - int((self.table < self.n_pages).sum())
        return len(self.free) - reserved

    def need(self, prompt_len: int, total: int, n: int) -> int:
        """Pages a request may ever hold: ``n`` samples of a ``prompt_len`` prompt, ``total``
        slots each (prompt and ``max_tokens``), the prompt's whole pages shared."""
        shared = prompt_len // self.size
        return shared + n * (pages_of(total, self.size) - shared)

    def admit(self, rows: list[int], prompt_len: int, total: int, cached: list[int]) -> None:
        """``rows`` (one per sample) take their prompt's pages and reserve the rest: the first
        row lists the ``cached`` pages (a cached prefix's, shared) and then its own, the others
        share its whole ones and each take a page of their own for the prompt's last partial
        one (the engine copies it there once the prompt is read)."""
        first, shared = rows[0], prompt_len // self.size
        self.limit[rows] = pages_of(total, self.size)
        self.table[first, :len(cached)] = cached
        self.refs[np.asarray(cached, np.int32)] += 1
        self._take(first, pages_of(prompt_len, self.size))
        for row in rows[1:]:
            self.table[row, :shared] = self.table[first, :shared]
            self.refs[self.table[first, :shared]] += 1
            if prompt_len % self.size:
                self._take(row, shared + 1)

    def grow(self, row: int, n_slots: int) -> None:
        """Row ``row`` holds pages for its first ``n_slots`` slots (up to its reservation)."""
        self._take(row, min(pages_of(n_slots, self.size), int(self.limit[row])))

    def release(self, row: int) -> None:
        """Row ``row``'s sequence ended: its pages lose a holder, its reservation is void."""
        self.unref(self.table[row][self.table[row] < self.n_pages])
        self.table[row], self.limit[row] = self.n_pages, 0

    def unref(self, pages) -> None:
        """``pages`` lose a holder; those none holds are free."""
        self.refs[np.asarray(pages, np.int32)] -= 1
        self.free.extend(int(p) for p in pages if self.refs[p] == 0)

    def _take(self, row: int, n_pages: int) -> None:
        """Free pages appended to ``row``'s table until it lists ``n_pages``."""
        held = int((self.table[row] < self.n_pages).sum())
        for i in range(held, n_pages):
            page = self.free.pop()
            self.table[row, i], self.refs[page] = page, 1


def paging(slotted, page_size: int | None, n_pages: int | None, max_seqs: int, max_len: int,
           images) -> Pages | None:
    """The engine's ``Pages`` for ``page_size`` (None: slots, no pages), ``n_pages`` by default
    as many slots as ``max_seqs`` rows of ``max_len``; what it cannot page is refused (a
    recurrent layer's state is not paged but kept a row's own: ``engine_paged.pool_of``)."""
    if page_size is None:
        return None
    if page_size < 1 or max_len % page_size:
        raise ValueError(f"page_size={page_size}: give a size >= 1 that divides max_len "
                         f"({max_len}), e.g. 16.")
    if not any(jax.tree.leaves(slotted)):
        raise ValueError("page_size: this model holds no key and value per slot (every layer "
                         "recurrent: one state a row), so there is nothing to page: leave "
                         "page_size unset (slots).")
    if images is not None:
        raise ValueError("page_size with an image model is not done: leave page_size unset "
                         "(slots) for it.")
    n_pages = max_seqs * max_len // page_size if n_pages is None else n_pages
    if n_pages < 1:
        raise ValueError(f"n_pages={n_pages}: give at least one page.")
    return Pages(n_pages, page_size, max_seqs, max_len)
