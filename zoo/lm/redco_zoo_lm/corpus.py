"""A tokenized corpus on disk, read without loading it into memory.

The layout is a flat file of token ids (``.bin``, uint16 or uint32, documents one after another,
each ending in an EOS token), as nanoGPT and many users already have. Opening it the first time
scans the file, a few million tokens at a time, for the EOS tokens (and its largest id, checked
against the vocabulary), printing its progress on a large file. Each document's end goes to a
file as the scan finds it (``<file>.index/``, ``redco_zoo_lm/disk_arrays.py``), read back by the
next opening while the file's size and modification time are unchanged, so a restart does not
scan again, and read a few ends at a time: memory does not grow with the number of documents.
A document is read when asked for, with ``os.pread``: nothing maps or holds the file, so
resident memory does not grow with it. Each read first checks that the file was not written to
since it was indexed (its size and modification time), so a job whose file is changed under it
stops with a message instead of training on rows that are no longer the ones planned.
"""
from __future__ import annotations

import hashlib
import os
import sys
import time
import weakref

import numpy as np

from redco.protocols import UsageError
from redco_zoo_lm.disk_arrays import ArrayWriter, DiskArray, kept

SCAN_TOKENS = 1 << 22  # tokens read per step of the scan (8 MB of uint16)
PROGRESS_EVERY_S = 10.0


class Progress:
    """Prints ``what``'s progress to stderr, at most every ``PROGRESS_EVERY_S`` seconds, once
    it has taken that long (a small corpus prints nothing)."""

    def __init__(self, what: str, total: int, unit: str):
        self.what, self.total, self.unit, self.every = what, total, unit, PROGRESS_EVERY_S
        self.started = self.shown = time.monotonic()

    def __call__(self, done: int) -> None:
        now = time.monotonic()
        if now - self.shown >= self.every:
            self.shown = now
            print(f"{self.what}: {done / self.total:.0%} of {self.total:,} {self.unit} "
                  f"({now - self.started:.0f} s)", file=sys.stderr, flush=True)


class TokenFile:
    """The documents of ``path``: ``len()`` of them, ``document(i)`` the ids of one (its EOS
    included), ``lengths`` all their lengths. ``vocab_size``: refuse any id at or above it."""

    def __init__(self, path: str, eos_id: int, dtype=np.uint16, vocab_size: int | None = None):
        self.path, self.dtype, self.eos_id, self._fd = path, np.dtype(dtype), eos_id, None
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
        folder, index = kept(path + ".index", self.key, self._scan)
        if vocab_size is not None and index["max_id"] >= vocab_size:
            raise UsageError(
                f"{self.path}: token {index['max_at']} is id {index['max_id']}, beyond "
                f"the model's vocabulary of {vocab_size}. Was the file made with another "
                f"tokenizer, or read with the wrong dtype ({self.dtype.name})?")
        self.ends = DiskArray(os.path.join(folder, "ends.i64"), np.int64)  # one past each doc
        self.documents_sha256 = index["documents_sha256"]  # their lengths, first and last tokens

    def _scan(self, folder: str) -> dict:
        """Writes each document's end (``ends.i64``); returns the largest id, where it first
        is, and a digest of the documents' lengths and the file's first and last tokens."""
        ends, digest = ArrayWriter(os.path.join(folder, "ends.i64"), np.int64), hashlib.sha256()
        max_id, max_at, last_end = -1, 0, 0
        progress = Progress(f"indexing {self.path}", self.n_tokens, "tokens")
        with open(self.path, "rb") as f:
            for begin in range(0, self.n_tokens, SCAN_TOKENS):
                chunk = np.fromfile(f, self.dtype, min(SCAN_TOKENS, self.n_tokens - begin))
                if chunk.max() > max_id:
                    max_id, max_at = int(chunk.max()), begin + int(np.argmax(chunk))
                found = np.flatnonzero(chunk == self.eos_id) + begin + 1
                if begin + len(chunk) == self.n_tokens and (not len(found) or found[-1] != self.n_tokens):
                    found = np.append(found, self.n_tokens)  # the last document has no EOS
                digest.update(np.diff(found, prepend=last_end).astype(np.int64).tobytes())
                ends.write(found)
                last_end = int(found[-1]) if len(found) else last_end
                progress(begin + len(chunk))
        ends.close()
        digest.update(self.key["ends_sha256"].encode())  # (and of its first and last tokens)
        return {"max_id": max_id, "max_at": max_at, "documents_sha256": digest.hexdigest()}

    def __len__(self) -> int:
        return len(self.ends)

    def spans(self, first: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """``(starts, lengths)`` of documents ``first`` to ``stop``."""
        ends = self.ends[max(first - 1, 0):stop]
        starts = np.concatenate([[0], ends[:-1]]) if first == 0 else ends[:-1]
        ends = ends if first == 0 else ends[1:]
        return starts.astype(np.int64), ends - starts

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
        (start,), (length,) = self.spans(i, i + 1)
        return self.tokens(int(start), int(length))


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
