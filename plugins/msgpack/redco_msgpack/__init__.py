"""The ``msgpack`` checkpoint format for Redco: ``Deployer(checkpoint_format="msgpack")``.

A checkpoint's ``state/`` holds one ``state.msgpack``: the tree as nested dicts keyed by the
parts of each array's path (``redco.checkpointing.nest``), in Flax's serialization format, as
the original Redco wrote it; ``flax.serialization.msgpack_restore`` reads it without redco.

Writing gathers every array to process 0's host memory (``redco.checkpointing.host_arrays``).
Reading decodes the whole file on every process, then places each process's shards onto any
mesh (``redco.checkpointing.place``). Flax's decoder builds arrays of numbers only; an entry of
any other kind (an object array a forged file could carry) is refused, never unpickled.
"""
from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
from flax import serialization

from redco import hookimpl
from redco.checkpointing import host_arrays, leaf_at, nest, place
from redco.protocols import CheckpointFormat

FILE = "state.msgpack"


class MsgpackFormat(CheckpointFormat):
    def save(self, path: str, tree: Any) -> None:
        arrays = host_arrays(tree)  # a collective: every process takes part
        if jax.process_index() != 0:
            return
        os.makedirs(path)
        with open(os.path.join(path, FILE), "wb") as f:
            f.write(serialization.msgpack_serialize(nest(arrays)))

    def load(self, path: str, target: Any) -> Any:
        with open(os.path.join(path, FILE), "rb") as f:
            nested = serialization.msgpack_restore(f.read())
        if not isinstance(nested, dict):
            raise ValueError(f"expected a dict of arrays, found {type(nested).__name__}")

        def read(p: str, index: tuple) -> np.ndarray:
            node = leaf_at(nested, p)
            if not isinstance(node, np.ndarray) or node.dtype.hasobject:
                raise ValueError(f"{p} is a {type(node).__name__}, not an array of numbers")
            return node[index]
        return place(target, read)


@hookimpl
def register_checkpoint_formats(register):
    register("msgpack", MsgpackFormat())
