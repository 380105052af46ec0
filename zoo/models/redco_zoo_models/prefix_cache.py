"""Prefix caching for the engine (``redco_zoo_models.engine``): which prompt each cache row
still holds, so that a new request whose prompt starts the same way copies those slots from
that row (on the device) and reads only the rest.

A prompt is cut into blocks of ``BLOCK`` tokens; block ``i``'s key is a hash of block ``i - 1``'s
key and its own tokens, so a key names the whole prefix up to it and prefixes match by whole
blocks. A row is held here from the end of its prompt's prefill while its slots stay intact:
while it decodes (it writes past its prompt only) and after its sequence ends, until the row is
taken for another prompt (``drop``). A match is checked against the row's tokens (a hash that
collides matches nothing), and leaves at least one token to read (the prompt's last logits
come from its prefill). ``clear`` forgets every row: the engine's weights changed, and keys
computed with the old ones would be wrong.

``stats``: requests that found a prefix (``hits``) or none (``misses``), and prompt tokens
copied (``tokens_reused``) against those read (``tokens_read``): the prefill work saved.
"""
from __future__ import annotations

BLOCK = 16  # tokens a block: prefixes match by whole blocks


class PrefixCache:
    """The prompts that rows of an engine's cache hold, by block keys (module docstring)."""

    def __init__(self, block: int = BLOCK):
        self.block = block
        self.rows_of: dict[int, set[int]] = {}  # a block key -> the rows holding that prefix
        self.held: dict[int, tuple[list[int], list[int]]] = {}  # row -> (prompt, block keys)
        self.stats = {"hits": 0, "misses": 0, "tokens_reused": 0, "tokens_read": 0}

    def keys(self, prompt: list[int]) -> list[int]:
        """The key of each whole block of ``prompt``, each naming the prefix up to it."""
        keys, key = [], 0
        for start in range(0, len(prompt) - self.block + 1, self.block):
            key = hash((key, tuple(prompt[start:start + self.block])))
            keys.append(key)
        return keys

    def add(self, row: int, prompt: list[int]) -> None:
        """Row ``row`` now holds ``prompt``'s keys and values in its first slots."""
        self.drop(row)
        keys = self.keys(prompt)
        self.held[row] = (list(prompt), keys)
        for key in keys:
            self.rows_of.setdefault(key, set()).add(row)

    def drop(self, row: int) -> None:
        """Row ``row`` is taken for another prompt: it no longer holds its old one."""
        _, keys = self.held.pop(row, (None, []))
        for key in keys:
            self.rows_of[key].discard(row)
            if not self.rows_of[key]:
                del self.rows_of[key]

    def clear(self) -> None:
        """Forget every row (the weights changed)."""
        self.rows_of.clear()
        self.held.clear()

    def match(self, prompt: list[int]) -> tuple[int | None, int]:
        """``(row, n)``: a row whose first ``n`` slots hold ``prompt[:n]``, ``n`` the most
        whole blocks that leave a token of ``prompt`` to read; ``(None, 0)``: none."""
        keys = self.keys(prompt[:len(prompt) - 1])
        for n_blocks in range(len(keys), 0, -1):
            n = n_blocks * self.block
            for row in sorted(self.rows_of.get(keys[n_blocks - 1], ())):
                if self.held[row][0][:n] == prompt[:n]:
                    return row, n
        return None, 0

    def shared(self, prompt: list[int], others: list[list[int]]) -> int:
        """The most tokens, in whole blocks leaving one of ``prompt`` to read, that ``prompt``
        shares with the start of any of ``others`` (prompts being read, not yet held)."""
        keys, best = self.keys(prompt[:len(prompt) - 1]), 0
        for other in others:
            same = [a == b for a, b in zip(keys, self.keys(other))] + [False]
            best = max(best, same.index(False))
        return best * self.block

    def count(self, reused: int, read: int) -> None:
        """One request admitted: ``reused`` tokens copied, ``read`` left to read."""
        self.stats["hits" if reused else "misses"] += 1
        self.stats["tokens_reused"] += reused
        self.stats["tokens_read"] += read
