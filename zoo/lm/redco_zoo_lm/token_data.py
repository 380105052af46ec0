"""The LM zoo's tokenized data on the command line: ``--train``/``--eval`` as a token file
(``.bin``), a folder of them (one corpus, its files in name order), or a weighted mixture of
those (``web.bin=0.7,books/=0.3``), their documents packed into rows (``--no_pack``: a document
a row, padded).

A token file's EOS id, dtype and vocabulary come from the settings (``LMData``'s ``eos_id``
and ``token_dtype``: ``--eos_id``, ``--token_dtype``), else from its manifest (``corpus.json``
beside ``corpus.bin``, as ``redco tokenize`` writes it), else from the model's ``config.json``.
"""
from __future__ import annotations

import glob
import json
import os
from collections.abc import Sequence

import numpy as np

from redco.protocols import UsageError
from redco_zoo_lm.corpus import TokenFile
from redco_zoo_lm.mixture import Concat, Mixture
from redco_zoo_lm.packing import PackedRows
from redco_zoo_lm.settings import LMData


def parse_sources(spec: str) -> dict[str, float]:
    """``"a.bin=0.7,books/=0.3"`` -> ``{"a.bin": 0.7, "books/": 0.3}``; one path: weight 1."""
    sources = {}
    for part in spec.split(","):
        path, _, weight = part.partition("=")
        try:
            sources[path] = float(weight) if weight else 1.0
        except ValueError:
            raise UsageError(f"{spec!r}: {weight!r} is not a weight; write "
                             "PATH=WEIGHT,PATH=WEIGHT (e.g. web.bin=0.7,books/=0.3).") from None
    return sources


def token_files(path: str) -> list[str]:
    """The token files ``path`` names: itself (a ``.bin``), or a folder's, in name order."""
    if os.path.isdir(path):
        return sorted(glob.glob(os.path.join(path, "*.bin")))
    return [path] if path.endswith(".bin") else []


def is_token_data(spec: str) -> bool:
    """Whether ``spec`` names token files (else: text data)."""
    return all(token_files(path) for path in parse_sources(spec))


def manifest_of(path: str) -> dict:
    """``redco tokenize``'s manifest of the token file ``path`` (empty where there is none)."""
    found = os.path.splitext(path)[0] + ".json"
    if not os.path.isfile(found):
        return {}
    with open(found) as f:
        return json.load(f)


def corpus_rows(path: str, data: LMData, seed: int, config: dict) -> PackedRows | Concat:
    """The rows of one token file, or of a folder's files one after another, packed for
    ``seed`` (``config``: the model's ``config.json``)."""
    files = token_files(path)
    if not files:
        raise UsageError(f"{path}: no token files (.bin) there.")
    parts = []
    for file in files:
        manifest = manifest_of(file)
        eos = next((e for e in (data.eos_id, manifest.get("eos_id"), config.get("eos_token_id"))
                    if e is not None), None)
        eos = eos[0] if isinstance(eos, list) else eos
        if eos is None:
            raise UsageError(f"--eos_id: give the id that ends each document of {file}; it has "
                             "no manifest and the model's config.json names no eos_token_id.")
        dtype = np.dtype(data.token_dtype or manifest.get("dtype", "uint16"))
        packed = PackedRows(TokenFile(file, eos, dtype, config.get("vocab_size")),
                            data.block_size, seed=seed, packed=data.pack)
        print(f"{file}: {len(packed.corpus)} documents, {packed.corpus.n_tokens} tokens in "
              f"{len(packed)} rows of {data.block_size + 1}, {packed.padding_share:.2%} "
              "padding", flush=True)
        parts.append(packed)
    return parts[0] if len(parts) == 1 else Concat(parts)


def token_rows(spec: str, data: LMData, seed: int, config: dict) -> Sequence:
    """``spec``'s rows: one corpus, or a mixture of several by their weights, drawn for
    ``seed``."""
    sources = parse_sources(spec)
    if len(sources) == 1:
        return corpus_rows(next(iter(sources)), data, seed, config)
    mixture = Mixture({path: (corpus_rows(path, data, seed, config), weight)
                       for path, weight in sources.items()}, seed=seed)
    print(f"{spec}: a mixture of {len(mixture)} rows, shares " + ", ".join(
        f"{name} {share:.1%}" for name, share in mixture.shares().items()), flush=True)
    return mixture
