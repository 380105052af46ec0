"""Integer arrays that live on disk, written once in pieces and read a slice at a time.

A token file's document index and packing plan grow with the corpus (a few integers per
document and per row: gigabytes for a corpus of billions of tokens), so neither is ever held
whole. ``ArrayWriter`` appends pieces to a raw file (little-endian, fixed dtype); ``DiskArray``
reads an element or a slice with ``os.pread``: nothing maps the file, so what a process holds
does not grow with it, however much of the array training visits.

``kept(folder, key, make)`` keeps such arrays in a folder beside the corpus: ``make(tmp)``
writes them into a fresh folder and returns a few facts about them, saved as ``meta.json`` with
``key``; the folder is renamed into place whole, so a kill mid-write leaves either the old
folder, the new one or a ``.tmp-*`` folder that is never read. The next ``kept`` with the same
``key`` reads ``meta.json`` back and makes nothing. Where the corpus's folder cannot be written
(a read-only dataset), the arrays go to the temporary directory instead.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import weakref
from typing import Callable

import numpy as np


class DiskArray:
    """The array in ``path`` (raw ``dtype``): ``len()``, ``[i]``, ``[a:b]`` (read when asked)."""

    def __init__(self, path: str, dtype):
        self.path, self.dtype = path, np.dtype(dtype)
        self._fd = os.open(path, os.O_RDONLY)
        weakref.finalize(self, os.close, self._fd)
        self._len = os.fstat(self._fd).st_size // self.dtype.itemsize

    def __len__(self) -> int:
        return self._len

    def read(self, start: int, stop: int) -> np.ndarray:
        """Elements ``start`` to ``stop`` (clipped to the array)."""
        start, stop = max(start, 0), min(stop, self._len)
        size = self.dtype.itemsize
        data = os.pread(self._fd, max(stop - start, 0) * size, start * size)
        return np.frombuffer(data, self.dtype)

    def __getitem__(self, i: int | slice):
        if isinstance(i, slice):
            start, stop, step = i.indices(self._len)
            if step != 1:
                raise IndexError("a DiskArray is read in contiguous slices")
            return self.read(start, stop)
        if not -self._len <= i < self._len:
            raise IndexError(f"element {i} of {self._len}")
        return self.read(i % self._len, i % self._len + 1)[0]

    def pieces(self, size: int = 1 << 22):
        """``(start, elements)`` of the whole array, ``size`` elements at a time."""
        for start in range(0, self._len, size):
            yield start, self.read(start, start + size)


class ArrayWriter:
    """Appends pieces to a raw ``dtype`` file: ``write(values)``; ``close()`` when done."""

    def __init__(self, path: str, dtype):
        self.dtype, self.n = np.dtype(dtype), 0
        self._file = open(path, "wb")

    def write(self, values) -> None:
        values = np.asarray(values).astype(self.dtype.newbyteorder("<"), copy=False)
        values.tofile(self._file)
        self.n += len(values)

    def close(self) -> None:
        self._file.close()


def kept(path: str, key: dict, make: Callable[[str], dict]) -> tuple[str, dict]:
    """``(folder, meta)``: the folder of arrays ``make(folder)`` wrote for ``key`` (module
    docstring), made now unless a complete one for the same ``key`` is there already."""
    try:
        return kept_in(path, key, make)
    except OSError:  # the corpus's folder cannot be written (read-only, or a file in the way)
        name = hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:12]
        return kept_in(os.path.join(tempfile.gettempdir(), "redco-corpus-arrays",
                                    f"{name}-{os.path.basename(path)}"), key, make)


def kept_in(folder: str, key: dict, make: Callable[[str], dict]) -> tuple[str, dict]:
    """``kept``, in ``folder``."""
    meta = read_meta(folder)
    if meta is not None and meta.get("key") == key:
        return folder, meta
    os.makedirs(os.path.dirname(os.path.abspath(folder)), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(folder) + ".tmp-",
                           dir=os.path.dirname(os.path.abspath(folder)))
    try:
        meta = {**make(tmp), "key": key}
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f)
        current = read_meta(folder)
        if current is not None and current.get("key") == key:
            return folder, current  # made meanwhile by another process: that one is read
        if os.path.isdir(folder):  # another key's (the corpus changed): replaced
            shutil.rmtree(folder)
        os.rename(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder, meta


def read_meta(folder: str) -> dict | None:
    """A kept folder's ``meta.json`` (None where there is none or it is unreadable)."""
    try:
        with open(os.path.join(folder, "meta.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
