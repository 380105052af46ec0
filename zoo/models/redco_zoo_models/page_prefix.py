"""Prefix caching on the paged cache (``Engine(page_size=..., prefix_caching=True)``): the
row-based cache's behaviour (``prefix_cache``: prompts matched by whole blocks of hashed keys,
checked against their tokens, at least one token left to read; a prompt that shares more with
one still being read waits for it; the same ``stats``; forgotten when the weights change) with
pages for blocks, shared rather than copied.

A block is a page. When a prompt has been read, each of its whole pages is kept under its
block's key, the cache holding a reference to it (``Pages.refs``), so the page outlives the
sequence. A request whose prompt starts with cached blocks lists those pages first in its page
table (one more reference each) and reads from after them: no slot is copied. A page is free
again when its count falls to 0: its sequences have ended and the cache let it go, either
evicted (least recently used first, when a request's pages would not fit otherwise; pages a
running sequence holds are not evictable) or cleared with the weights.
"""
from __future__ import annotations

from collections import OrderedDict

from redco_zoo_models.pages import Pages
from redco_zoo_models.prefix_cache import PrefixCache


class PagePrefixCache(PrefixCache):
    """Cached prompt prefixes as pages of ``pages``' pool (module docstring)."""

    def __init__(self, pages: Pages):
        super().__init__(pages.size)
        self.pages = pages
        self.entries: OrderedDict[int, tuple[int, int, list[int]]] = OrderedDict()  # key ->
        # (page, the key before it, the block's tokens), least recently used first

    def add_pages(self, prompt: list[int], table) -> None:
        """A prompt read whole into the pages ``table`` lists: its whole pages are kept."""
        keys = self.keys(prompt)
        for i, (before, key) in enumerate(zip([0] + keys, keys)):
            if key not in self.entries:
                page = int(table[i])
                self.entries[key] = (page, before, prompt[i * self.block:(i + 1) * self.block])
                self.pages.refs[page] += 1
        self._used(keys)

    def match(self, prompt: list[int]) -> tuple[list[int], int]:
        """``(pages, n)``: the cached pages that hold ``prompt[:n]``, ``n`` the most whole
        blocks that leave a token to read (none: ``([], 0)``)."""
        keys = self.keys(prompt[:len(prompt) - 1])
        found = []
        for i, (before, key) in enumerate(zip([0] + keys, keys)):  # (each block's tokens and
            entry = self.entries.get(key)                          # the one before it checked:
            if entry is None or entry[1:] != (before, prompt[i * self.block:(i + 1) * self.block]):
                break                                              # the whole prefix is)
            found.append(entry[0])
        self._used(keys[:len(found)])
        return found, len(found) * self.block

    def _used(self, keys: list[int]) -> None:
        """``keys`` (a prefix's, in order) used now: the deepest evicted first."""
        for key in reversed(keys):
            if key in self.entries:
                self.entries.move_to_end(key)

    def evict(self, n_pages: int, keep: list[int]) -> None:
        """Let go of cached pages no sequence holds (not ``keep``), least recently used first,
        until ``n_pages`` are free or none is left to let go."""
        for key, (page, *_) in list(self.entries.items()):
            if n_pages <= 0:
                return
            if self.pages.refs[page] == 1 and page not in keep:
                del self.entries[key]
                self.pages.unref([page])
                n_pages -= 1

    def clear(self) -> None:
        """Let go of every cached page (the weights changed)."""
        self.pages.unref([page for page, *_ in self.entries.values()])
        self.entries.clear()
