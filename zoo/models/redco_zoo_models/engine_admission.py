"""How the engine (``redco_zoo_models.engine``) admits waiting requests into rows: first come
first served, ``MAX_PREFILL`` prompts read at a time (more short ones, while their padded
chunks fit ``PREFILL_TOKENS``: ``prompts_per_prefill``), each request's ``n`` samples a row
each; with a paged cache (``redco_zoo_models.pages``) also only while the pages it may ever
hold fit beside those held and reserved (so admission is bounded by pages, not by ``max_seqs
x max_len`` slots), and a row gives its pages back when its sequence ends."""
from __future__ import annotations

import numpy as np

from redco_zoo_models.engine_reading import Reading
from redco_zoo_models.pages import Pages
from redco_zoo_models.requests import Request

MAX_PREFILL = 8  # prompts read per step at most (but see PREFILL_TOKENS): the rest wait a step,
PREFILL_TOKENS = 512  # decoding goes on; short prompts: as many as fit this many padded tokens


def prompts_per_prefill(width: int) -> int:
    """The most prompts one prefill reads at padded ``width``: ``MAX_PREFILL``, or more short
    ones while they take at most ``PREFILL_TOKENS`` (a burst of short prompts is read in fewer
    steps: fewer decode steps until all run, each as cheap)."""
    return max(MAX_PREFILL, PREFILL_TOKENS // width)


class Admission:
    """The engine's admission of requests into rows (a part of ``Engine``, on its state)."""

    pages: Pages | None

    def _admit(self) -> None:
        """Waiting requests take free rows (first come first served, ``prompts_per_prefill``
        prompts read at a time): with prefix caching, a cached prefix's row is taken if free
        (else its slots are copied), other rows least recently freed first; a request that
        shares more with a prompt still being read than with any held waits until that one is
        held."""
        free, admitted = self._free_rows(), []
        while self.waiting and len(free) >= self.waiting[0].sampling.n and \
                self._room_to_read(self.waiting[0]) and self._pages_fit(self.waiting[0]):
            request = self.waiting[0]
            donor, read = self.prefix.match(request.prompt) if self.prefix else (None, 0)
            if self.prefix is not None and not request.cancelled and self.prefix.shared(
                    request.prompt, [r.request.prompt for r in self.reading]) > read:
                break
            with self._wake:
                self.waiting.popleft()
            if request.cancelled:
                self._end(request, "cancelled")
                continue
            if self.pages is not None:  # (a paged donor: the cached pages, listed, not copied)
                self.pages.admit(free[:request.sampling.n], len(request.prompt), _total(request),
                                 donor or [])
                donor = None
            rows = ([donor] if donor in free else []) + [r for r in free if r != donor]
            rows = rows[:request.sampling.n]
            free = [r for r in free if r not in rows]
            if self.prefix is not None:
                self.prefix.count(read, len(request.prompt) - read)
                for row in rows:  # (a donor is never a target: it is the request's own row,
                    self.prefix.drop(row)  # or running; a row taken is at once no donor)
            self.reading.append(Reading(request, rows, read, None if donor in rows else donor))
            admitted.append((request, rows))
        if admitted:
            self._seed_rows(admitted)

    def _room_to_read(self, request: Request) -> bool:
        """Whether this step's prefill reads one more prompt, ``request``'s (its first chunk
        taken whole: a cached prefix only shortens it, so the shape stays one ``warm_up`` ran)."""
        chunks = [min(self.chunk, len(r.request.prompt) - r.read) for r in self.reading]
        longest = max(chunks + [min(self.chunk, len(request.prompt))])
        return len(self.reading) < prompts_per_prefill(self._width(longest))

    def _pages_fit(self, request: Request) -> bool:
        """Whether the pages ``request`` may ever hold fit now (always, on slots), cached
        prefixes' pages evicted for it if need be (not those it would match)."""
        if self.pages is None:
            return True
        need = self.pages.need(len(request.prompt), _total(request), request.sampling.n)
        if self.prefix is not None and (short := need - self.pages.available()) > 0:
            self.prefix.evict(short, keep=self.prefix.match(request.prompt)[0])
        return self.pages.available() >= need

    def _free_rows(self) -> list[int]:
        """Free rows, lowest first; with prefix caching, least recently freed first (what a row
        freed lately holds is likelier asked for again)."""
        free = [i for i, row in enumerate(self.rows) if row is None]
        return sorted(free, key=lambda i: self.freed[i]) if self.prefix is not None else free

    def _seed_rows(self, admitted: list[tuple[Request, list[int]]]) -> None:
        """Each admitted sample's row: its request, its slot after the prompt, its key."""
        targets, seeds, samples = np.zeros((3, self.max_seqs), np.int32)
        n_rows = 0
        for request, rows in admitted:
            written = slice(n_rows, n_rows + len(rows))
            targets[written], samples[written] = rows, range(len(rows))
            seeds[written] = request.sampling.seed if request.sampling.seed is not None \
                else next(self._seeds) % 2 ** 31
            n_rows += len(rows)
            for sample, row in enumerate(rows):
                self.rows[row], self.slot[row] = (request, sample), len(request.prompt)
        self.row_keys[targets[:n_rows]] = np.asarray(self._keys(seeds, samples))[:n_rows]

    def _free_row(self, row: int) -> None:
        """Row ``row``'s sequence ended: the row (and its pages) free for the next admit."""
        self.rows[row], self.freed[row] = None, next(self._ticks)
        if self.pages is not None:
            self.pages.release(row)

    def _grow(self, running: list[int], bucket: int) -> tuple:
        """The decode step's page table argument (``_tables``), each running row holding
        pages for the slots the step writes."""
        for row in running if self.pages is not None else ():
            self.pages.grow(row, int(self.slot[row]) + self.steps_per_sync)
        return self._tables(bucket)

    def _tables(self, bucket: int) -> tuple:
        """The decode step's page tables of the first ``bucket`` rows (none on slots)."""
        return () if self.pages is None else (self.pages.table[:bucket].copy(),)

    def _page_copies(self, done: list[Reading]) -> tuple:
        """The prefill's page arguments: the page tables, and for each prompt read whole its
        last partial page copied into its other samples' (none on slots)."""
        if self.pages is None:
            return ()
        copies = np.zeros((2, self.max_seqs), np.int32)
        n = 0
        for r in done:
            shared = len(r.request.prompt) // self.pages.size
            for row in r.rows[1:] if len(r.request.prompt) % self.pages.size else ():
                copies[:, n] = self.pages.table[r.rows[0], shared], self.pages.table[row, shared]
                n += 1
        return self.pages.table.copy(), copies, np.int32(n)

    def _check_pages(self, request_len: int, max_tokens: int, n: int) -> None:
        """Refuse a request whose pages would not fit the whole pool."""
        if self.pages is not None and (need := self.pages.need(
                request_len, request_len + max_tokens, n)) > self.pages.n_pages:
            raise ValueError(f"The prompt ({request_len} tokens), max_tokens ({max_tokens}) and "
                             f"n={n} may take {need} pages of {self.pages.size} slots; this "
                             f"engine's pool holds {self.pages.n_pages}: shorten either, or "
                             "start the engine with more n_pages.")


def _total(request: Request) -> int:
    """The slots each of ``request``'s samples may fill: its prompt and ``max_tokens``."""
    return len(request.prompt) + request.sampling.max_tokens

