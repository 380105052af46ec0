"""A tokenized corpus on disk, read without loading it into memory.

The layout is a flat file of token ids (``.bin``, uint16 or uint32, documents one after another,
each ending in an EOS token), as nanoGPT and many users already have. Opening it the first time
scans the file, a few million tokens at a time, for the EOS tokens (and its largest id, checked
against the vocabulary); what stays in memory is two integers per document. The scan's result
is kept beside the file (``<file>.index.npz``) and read back by the next opening while the
file's size and modification time are unchanged, so a restart does not scan again. A document
is read when asked for, with ``os.pread``: nothing maps or holds the file, so resident memory
does not grow with it. Each read first checks that the file was not written to since it was
indexed (its size and modification time), so a job whose file is changed under it stops with
a message instead of training on rows that are no longer the ones planned.
"""
from __future__ import annotations

import hashlib
import json
import os
import weakref
from typing import Callable

import numpy as np

from redco.protocols import UsageError

SCAN_TOKENS = 1 << 22  # tokens read per step of the scan (8 MB of uint16)


def kept_arrays(path: str, key: dict, make: Callable[[], dict]) -> dict:
    """``make()``'s arrays, kept in ``path`` (``.npz``) with ``key`` and read back from it
    while ``key`` is the same. Where ``path`` cannot be written, they are made each time."""
    try:
        with np.load(path) as kept:
            if json.loads(str(kept["key"])) == key:
                return {name: kept[name] for name in kept.files if name != "key"}
    except (OSError, ValueError, KeyError):  # none yet, another key, or unreadable: remade
        pass
    arrays = make()
    try:
        np.savez(path + ".tmp.npz", key=json.dumps(key), **arrays)
        os.replace(path + ".tmp.npz", path)  # whole or not at all
    except OSError:
        pass
    return arrays


class TokenFile:
    """The documents of ``path``: ``len()`` of them, ``document(i)`` the ids of one (its EOS
    included), ``lengths`` all their lengths. ``vocab_size``: refuse any id at or above it."""

    def __init__(self, path: str, eos_id: int, dtype=np.uint16, vocab_size: int | None = None):
        self.path, self.dtype, self._fd = path, np.dtype(dtype), None
        size = os.path.getsize(path)
        if size % self.dtype.itemsize:
            raise UsageError(f"{path} is {size} bytes, not a whole number of {self.dtype.name} "
                             "tokens: the file is truncated, or was written with another dtype.")
        self.n_tokens = size // self.dtype.itemsize
        if self.n_tokens == 0:
            raise UsageError(f"{path} holds no tokens.")
        ends_digest = hashlib.sha256()  # of its first and last tokens
        for start in (0, max(0, self.n_tokens - 4096)):
            ends_digest.update(self.tokens(start, min(4096, self.n_tokens)).tobytes())
        self.key = {"size": size, "mtime_ns": os.stat(path).st_mtime_ns, "eos_id": eos_id,
                    "dtype": self.dtype.name, "ends_sha256": ends_digest.hexdigest()[:16]}
        index = kept_arrays(path + ".index.npz", self.key, lambda: self._scan(eos_id))
        if vocab_size is not None and index["max_id"] >= vocab_size:
            raise UsageError(
                f"{self.path}: token {int(index['max_at'])} is id {int(index['max_id'])}, beyond "
                f"the model's vocabulary of {vocab_size}. Was the file made with another "
                f"tokenizer, or read with the wrong dtype ({self.dtype.name})?")
        ends = index["ends"]  # one past each document's last token
        self.starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
        self.lengths = (ends - self.starts).astype(np.int64)

    def _scan(self, eos_id: int) -> dict:
        """Each document's end, the largest id and where it first is."""
        ends, max_id, max_at = [], -1, 0
        with open(self.path, "rb") as f:
            for begin in range(0, self.n_tokens, SCAN_TOKENS):
                chunk = np.fromfile(f, self.dtype, min(SCAN_TOKENS, self.n_tokens - begin))
                if chunk.size and chunk.max() > max_id:
                    max_id, max_at = int(chunk.max()), begin + int(np.argmax(chunk))
                ends.append(np.flatnonzero(chunk == eos_id) + begin + 1)
        ends = np.concatenate(ends)
        if ends.size == 0 or ends[-1] != self.n_tokens:  # the last document has no EOS
            ends = np.append(ends, self.n_tokens)
        return {"ends": ends, "max_id": np.int64(max_id), "max_at": np.int64(max_at)}

    def __len__(self) -> int:
        return len(self.starts)

    def tokens(self, start: int, count: int) -> np.ndarray:
        """``count`` token ids from token ``start`` on."""
        if self._fd is None:  # opened once, at the first read; closed with this object
            self._fd = os.open(self.path, os.O_RDONLY)
            weakref.finalize(self, os.close, self._fd)
        if hasattr(self, "key"):  # (the scan's own reads come before the key)
            self._refuse_a_change()
        data = os.pread(self._fd, count * self.dtype.itemsize, start * self.dtype.itemsize)
        return np.frombuffer(data, self.dtype)

    def _refuse_a_change(self) -> None:
        """Raise if the file was written to since it was indexed: its documents, and the rows
        planned from them, would no longer be what was read before (a file replaced by a new
        one under the same name is not seen: the open one is still read)."""
        now = os.fstat(self._fd)
        if (now.st_size, now.st_mtime_ns) != (self.key["size"], self.key["mtime_ns"]):
            raise UsageError(
                f"{self.path} changed while it was being read: it was {self.key['size']:,} "
                f"bytes, it is {now.st_size:,} bytes now, modified since. A job reads the token "
                "file it started with. Put the file back as it was and run the same command "
                "to resume from its last checkpoint (kept), or write the new data to another "
                "file and start a new run.")

    def document(self, i: int) -> np.ndarray:
        return self.tokens(int(self.starts[i]), int(self.lengths[i]))


def append_document(f, ids, eos_id: int, dtype) -> int:
    """Write one document's ``ids`` and the EOS after them to the open file ``f``; its length."""
    np.append(np.asarray(ids, np.int64), eos_id).astype(dtype).tofile(f)
    return len(ids) + 1


def write_token_file(path: str, documents, eos_id: int, dtype=np.uint16) -> str:
    """``documents`` (sequences of ids) written as a flat token file, each followed by EOS."""
    with open(path, "wb") as f:
        for doc in documents:
            append_document(f, doc, eos_id, dtype)
    return path
