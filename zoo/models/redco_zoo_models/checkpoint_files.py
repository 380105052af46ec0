"""A HuggingFace directory's safetensors files, read lazily: every tensor a read-only
``np.memmap`` view of its bytes in the file (the format is an 8-byte header length, a JSON
header of ``{name: {dtype, shape, data_offsets}}``, then the raw little-endian data). Nothing
is read until a tensor is used, so a loader that converts the tensors one by one (casting, or
quantising them: ``redco_zoo_models.quantize``) never holds the whole model in host memory,
and views of a tensor (a transpose, a fused tensor's parts) cost nothing. ``renamed`` reads a
checkpoint's names as the zoo's by their prefixes (and back)."""
from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16,
          "F8_E4M3": jnp.float8_e4m3fn, "F8_E5M2": jnp.float8_e5m2,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
          "BOOL": np.bool_}


def map_file(path: str) -> dict[str, np.ndarray]:
    """Every tensor of one ``.safetensors`` file, by name, as a lazy view into the file."""
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    data = np.memmap(path, np.uint8, mode="r", offset=8 + header_len)
    tensors = {}
    for name, info in header.items():
        if info["dtype"] not in DTYPES:
            raise ValueError(f"{path}: tensor {name} has dtype {info['dtype']}, which the zoo "
                             f"does not read; it reads {sorted(DTYPES)}.")
        start, end = info["data_offsets"]
        tensors[name] = data[start:end].view(DTYPES[info["dtype"]]).reshape(info["shape"])
    return tensors


def read_safetensors(model_dir: str) -> dict[str, np.ndarray]:
    """Every tensor of ``model.safetensors`` (or of the shards its index lists), by name, as
    lazy views (module docstring)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        path = os.path.join(model_dir, file)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} not found: from_pretrained reads a local directory "
                                    "with config.json and model.safetensors (safetensors only, "
                                    "no pytorch_model.bin).")
        tensors.update(map_file(path))
    return tensors


def renamed(tensors: dict, prefixes: list[tuple[str, str]]) -> dict:
    """``tensors`` with each name's first matching prefix ``old`` of ``prefixes``' ``(old,
    new)`` pairs replaced by ``new`` (a checkpoint's names read as the zoo's, or back)."""
    out = {}
    for name, t in tensors.items():
        for old, new in prefixes:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        out[name] = t
    return out
