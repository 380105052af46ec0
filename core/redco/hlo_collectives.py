"""The collectives of a compiled step, read off its optimized HLO text: per kind (all-gather,
all-reduce, reduce-scatter, all-to-all, collective-permute), how many ops and the bytes of
their results on one device.

The result bytes are what an op leaves on each device: an all-gather's gathered array, an
all-reduce's reduced one (the same size as its operand), a reduce-scatter's shard, an
all-to-all's exchanged buffer; of an asynchronous ``-start`` op, its outputs, not the operands
its result tuple also holds (an all-reduce-start's result is its output alone). What crosses
the wire per device follows from them with the
group size ``n``: all-gather and all-to-all ``(n-1)/n`` of the result, a ring all-reduce
``2 (n-1)/n`` of it, a reduce-scatter ``(n-1)`` shards. An op inside a loop body (``while``:
e.g. ``accumulate_grad_batches`` micro-batches) is counted once, as written in the HLO.

The layout planner reports them for every layout it compiles (``TriedLayout.collectives``) and
refuses an expert-parallel layout (``+ep`` rules) whose step has no all-to-all (the model's
MoE blocks did not run expert-parallel: they never read ``redco.fsdp.declared``); the zoo's
decode-layout chooser measures a decode step's traffic with them."""
from __future__ import annotations

import math
import re

import numpy as np

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_OP = re.compile(r"^\s*(?:ROOT\s+)?\S+\s*=\s*(.*?)\s(" + "|".join(KINDS) + r")(-start)?\(",
                 re.MULTILINE)  # one instruction a line: "%name = shape op(operands), ..."
_ARRAY = re.compile(r"\b(pred|[subf]\d+|bf16|c64|c128)\[([\d,]*)\]")
_DTYPES = {"pred": 1, "bf16": 2, "c64": 8, "c128": 16}


def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
    """``{kind: {"ops": n, "bytes": result bytes per device}}`` of ``hlo_text`` (a compiled
    executable's ``as_text()``), for the kinds it holds."""
    found: dict[str, dict[str, int]] = {}
    for match in _OP.finditer(hlo_text):
        shape, kind, started = match.groups()
        arrays = _ARRAY.findall(shape)
        if started and kind != "all-reduce":  # ((operands), (outputs)): the outputs
            arrays = arrays[len(arrays) // 2:]
        entry = found.setdefault(kind, {"ops": 0, "bytes": 0})
        entry["ops"] += 1
        entry["bytes"] += sum(math.prod(int(d) for d in dims.split(",") if d) * _itemsize(dtype)
                              for dtype, dims in arrays)
    return found


def _itemsize(dtype: str) -> int:
    if dtype in _DTYPES:
        return _DTYPES[dtype]
    return np.dtype({"f": "float", "s": "int", "u": "uint"}[dtype[0]] + dtype[1:]).itemsize
