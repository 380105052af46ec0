"""``redco tokenize``: text files to a token file (``corpus.bin``) that ``redco zoo run lm`` and
``redco_zoo_lm.corpus.TokenFile`` read.

Inputs are read as streams (``datasets``' ``streaming=True``), so a corpus larger than memory
goes through: ``.txt`` gives a document per line, ``.json``/``.jsonl``/``.csv``/``.parquet`` a
document per row (``--text_column``). Each batch of documents is tokenized by ``tokenizers``'
``encode_batch``, which uses every core, and appended to ``OUT.bin.tmp`` with the EOS id after
each document (uint16 where the vocabulary fits, else uint32).

**Interrupted, run it again.** After every batch ``OUT.bin.progress`` records how many
documents and bytes are in the ``.tmp`` file; a rerun with the same inputs cuts the file back
to that length, skips those documents and goes on. At the end the file is renamed to ``OUT.bin``
and ``OUT.json`` written beside it: the manifest (tokenizer, vocabulary, EOS id, dtype, inputs,
documents, tokens).
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
from typing import Iterable, Iterator

import numpy as np
from tqdm import tqdm

from redco.protocols import UsageError
from redco_zoo_lm.corpus import append_document

BATCH = 1000  # documents per encode_batch call and per progress record
FORMATS = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def read_documents(paths: list[str], text_column: str) -> Iterator[str]:
    """Every document of ``paths``, in order, streamed."""
    import datasets
    for path in paths:
        kind = FORMATS.get(os.path.splitext(path)[1])
        if kind is None:
            raise UsageError(f"{path}: not a {', '.join(FORMATS)} file.")
        if not os.path.isfile(path):
            raise UsageError(f"{path} not found.")
        rows = datasets.load_dataset(kind, data_files=path, split="train", streaming=True)
        column = "text" if kind == "text" else text_column
        for row in rows:
            if column not in row:
                raise UsageError(f"--text_column {column!r}: {path} has no such column. Its "
                                 f"columns: {sorted(row)}.")
            yield row[column]


def tokenize(tokenizer, documents: Iterable[str], out: str, eos_id: int, manifest: dict) -> dict:
    """Write ``documents`` to the token file ``out``, resuming an interrupted run (module
    docstring); the manifest written beside it."""
    dtype = np.uint16 if tokenizer.get_vocab_size() <= 1 << 16 else np.uint32
    tmp, progress = f"{out}.tmp", f"{out}.progress"
    done = {"documents": 0, "bytes": 0, "tokens": 0, "inputs": manifest["inputs"]}
    if os.path.exists(progress) and os.path.exists(tmp):
        with open(progress) as f:
            saved = json.load(f)
        if saved["inputs"] == manifest["inputs"]:
            done = saved
            print(f"{out}: resuming after {done['documents']} documents", flush=True)
    with open(tmp, "r+b" if done["bytes"] else "wb") as f:
        f.truncate(done["bytes"])
        f.seek(done["bytes"])
        documents = itertools.islice(documents, done["documents"], None)
        with tqdm(desc=f"tokenizing to {out}", unit=" docs", initial=done["documents"]) as bar:
            while batch := list(itertools.islice(documents, BATCH)):
                for encoding in tokenizer.encode_batch(batch):
                    done["tokens"] += append_document(f, encoding.ids, eos_id, dtype)
                f.flush()
                done["documents"] += len(batch)
                done["bytes"] = f.tell()
                with open(progress, "w") as p:
                    json.dump(done, p)
                bar.update(len(batch))
    manifest = {**manifest, "eos_id": eos_id, "dtype": np.dtype(dtype).name,
                "vocab_size": tokenizer.get_vocab_size(), "documents": done["documents"],
                "tokens": done["tokens"]}
    os.replace(tmp, out)
    with open(os.path.splitext(out)[0] + ".json", "w") as f:
        json.dump(manifest, f, indent=1)
    os.remove(progress)
    return manifest


class TokenizeCommand:
    description = "text files (txt, json, jsonl, csv, parquet) to a token file for the LM zoo"

    def add_arguments(self, parser) -> None:
        parser.add_argument("inputs", nargs="+", help="text files, read in this order")
        parser.add_argument("--tokenizer", required=True, help="a tokenizer.json (or the model "
                            "directory holding it)")
        parser.add_argument("--out", required=True, help="the token file to write (.bin)")
        parser.add_argument("--eos_token", help="the token that ends each document (default: "
                            "the tokenizer's </s>, <|endoftext|> or <eos>, whichever it has)")
        parser.add_argument("--text_column", default="text")

    def run(self, args) -> dict:
        from tokenizers import Tokenizer
        path = os.path.join(args.tokenizer, "tokenizer.json") \
            if os.path.isdir(args.tokenizer) else args.tokenizer
        if not os.path.isfile(path):
            raise UsageError(f"--tokenizer {args.tokenizer}: no tokenizer.json there.")
        tokenizer = Tokenizer.from_file(path)
        names = [args.eos_token] if args.eos_token else ["</s>", "<|endoftext|>", "<eos>"]
        eos_id = next((tokenizer.token_to_id(n) for n in names
                       if tokenizer.token_to_id(n) is not None), None)
        if eos_id is None:
            raise UsageError(f"--eos_token: {path} has no token {' or '.join(names)}; name the "
                             "token that ends a document.")
        with open(path, "rb") as f:
            sha = hashlib.sha256(f.read()).hexdigest()
        manifest = {"tokenizer": path, "tokenizer_sha256": sha,
                    "inputs": [os.path.abspath(p) for p in args.inputs]}
        return tokenize(tokenizer, read_documents(args.inputs, args.text_column), args.out,
                        eos_id, manifest)
