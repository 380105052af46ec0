"""Causal language modelling through the three functions, and ``redco zoo run lm``."""
from __future__ import annotations

import math
import os
from typing import Sequence

import jax.numpy as jnp
import numpy as np
import optax

import redco
from redco.protocols import UsageError
from redco_zoo_lm.corpus import TokenFile
from redco_zoo_lm.packing import PackedRows, hold_out
from redco_zoo_lm.tokenizing import TokenizeCommand
from redco_zoo_models import generate, runner


def collate_fn(examples: list[dict]) -> dict:
    """Examples hold equal-length ``token_ids`` (and, for packed rows, ``segment_ids``: one id
    per document, 0 for padding); the batch is ``input_ids`` (B, T) (and ``segment_ids``)."""
    batch = {"input_ids": np.stack([np.asarray(e["token_ids"], np.int32) for e in examples])}
    if "segment_ids" in examples[0]:
        batch["segment_ids"] = np.stack([np.asarray(e["segment_ids"], np.int32)
                                         for e in examples])
    return batch


def loss_fn(rng, state, params, batch, is_training):
    """Mean next-token cross-entropy. In packed rows (``segment_ids``) a document attends only
    to itself, and the prediction of the next document's first token and the padding's are
    left out: the mean is over the tokens predicted within their own document."""
    ids, segments = batch["input_ids"], batch.get("segment_ids")
    if segments is None:
        logits = state.apply_fn(params, ids[:, :-1]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()
    logits = state.apply_fn(params, ids[:, :-1], segment_ids=segments[:, :-1])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                             ids[:, 1:])
    counted = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] != 0)
    return (losses * counted).sum() / jnp.maximum(counted.sum(), 1)


def pred_fn(rng, params, batch, model, max_new_tokens: int = 64, temperature: float = 0.8):
    """``max_new_tokens`` sampled after each row of ``input_ids`` (``temperature`` 0: greedy);
    ``model`` gives the structure, ``params`` its weights."""
    return generate(model, params, batch["input_ids"], max_new_tokens, rng=rng,
                    temperature=temperature)


def text_blocks(texts: list[str], tokenizer, block_size: int, what: str = "the text") -> list[dict]:
    """The texts tokenized end to end and cut into examples of ``block_size + 1`` tokens."""
    ids = [i for text in texts for i in tokenizer.encode(text).ids]
    if len(ids) <= block_size:
        raise UsageError(f"{what} is {len(ids)} tokens, too few for one example of --block_size "
                         f"{block_size} (it takes {block_size + 1}): lower --block_size or give "
                         "more text.")
    return [{"token_ids": ids[i:i + block_size + 1]}
            for i in range(0, len(ids) - block_size, block_size)]


class LMPipeline:
    description = ("causal LM: train a decoder (LLaMA, Mistral, Qwen2, GPT-2) on text, or on a "
                   "token file (.bin, documents packed into rows); perplexity")

    def add_arguments(self, parser) -> None:
        runner.add_arguments(parser)
        parser.add_argument("--block_size", type=int, default=128, help="tokens per example")
        parser.add_argument("--text_column", default="text")
        parser.add_argument("--eos_id", type=int, help="a token file's (.bin) end-of-document "
                            "id (default: config.json's eos_token_id)")
        parser.add_argument("--token_dtype", default="uint16", choices=["uint16", "uint32"],
                            help="the ids' type in a token file (.bin)")

    def run(self, args) -> float:
        model, config = runner.load_model(args.model)
        if args.train.endswith(".bin"):  # tokenized already: documents packed into rows
            train, evaluate = token_file_rows(args, config)
        else:
            tokenizer = runner.load_tokenizer(args.model)
            parts = runner.split_eval(args, {"--text_column": args.text_column})
            train, evaluate = (
                text_blocks([r[args.text_column] for r in part], tokenizer, args.block_size, what)
                for part, what in zip(parts, ("--train", "--eval (or the last 5% of --train)")))
        trainer = runner.train_and_eval(args, model, (train, evaluate), collate_fn, loss_fn)
        perplexity = math.exp(trainer.eval_loss(evaluate, args.per_device_batch_size))
        trainer.deployer.log_info(f"eval perplexity {perplexity:.3f}")
        return perplexity


def token_file_rows(args, config: dict) -> tuple[Sequence, Sequence]:
    """``--train`` (and ``--eval``) token files, documents packed into rows of ``--block_size``
    + 1 tokens; without ``--eval``, every 20th row held out."""
    eos = args.eos_id if args.eos_id is not None else config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    if eos is None:
        raise UsageError(f"--eos_id: give the id that ends each document of {args.train}; "
                         f"{args.model}/config.json names no eos_token_id.")

    def rows(path: str) -> PackedRows:
        corpus = TokenFile(path, eos, np.dtype(args.token_dtype), config.get("vocab_size"))
        packed = PackedRows(corpus, args.block_size, seed=args.jax_seed)
        print(f"{path}: {len(corpus)} documents, {corpus.n_tokens} tokens in {len(packed)} rows "
              f"of {args.block_size + 1}, {packed.padding_share:.2%} padding", flush=True)
        return packed
    return (rows(args.train), rows(args.eval)) if args.eval else hold_out(rows(args.train))


@redco.hookimpl
def register_zoo_pipelines(register):
    register("lm", LMPipeline())


@redco.hookimpl
def register_commands(register):
    register("tokenize", TokenizeCommand())


@redco.hookimpl
def register_templates(register):
    register("lm", os.path.join(os.path.dirname(__file__), "template"))
