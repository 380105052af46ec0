"""Causal language modelling through the three functions, and ``redco zoo run lm``."""
from __future__ import annotations

import math
import os
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from redco.cli_parser import BooleanFlag
from redco.protocols import UsageError
from redco_zoo_lm.packing import hold_out
from redco_zoo_lm.plugin import DESCRIPTION
from redco_zoo_lm.settings import LMData
from redco_zoo_lm.token_data import is_token_data, manifest_of, parse_sources, token_files, token_rows
from redco_zoo_models import base_plan, flags, generate, runner
from redco_zoo_models.metrics import logits_and_experts, with_experts
from redco_zoo_models.settings import Data, ModelSource, RunConfig


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
    left out: the mean is over the tokens predicted within their own document. An MoE model adds
    its balancing losses and logs its experts' load (``with_experts``)."""
    ids, segments = batch["input_ids"], batch.get("segment_ids")
    if segments is None:
        logits, experts = logits_and_experts(state.apply_fn, params, ids[:, :-1])
        return with_experts(optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), ids[:, 1:]).mean(), experts)
    logits, experts = logits_and_experts(state.apply_fn, params, ids[:, :-1],
                                         segment_ids=segments[:, :-1])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                             ids[:, 1:])
    counted = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] != 0)
    return with_experts((losses * counted).sum() / jnp.maximum(counted.sum(), 1), experts)


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
    description = DESCRIPTION

    def add_arguments(self, parser) -> None:
        add_lm_arguments(parser)
        flags.add_training_levers(parser)

    def run(self, args) -> float:
        return train_lm(RunConfig.of_flags(args, LMData))


def train_lm(config: RunConfig[LMData]) -> float:
    """The whole LM run of ``config``; returns the held-out perplexity. A quantised base left
    to the planner is planned first (``redco_zoo_models.base_plan``)."""
    config = base_plan.planned(config, config.task.block_size)
    model, model_config = load_lm(config)
    examples = lm_examples(config, model_config)
    trainer = runner.train_and_eval(config, model, examples, collate_fn, loss_fn,
                                    tokenizer=config.task.tokenizer)
    perplexity = math.exp(trainer.eval_loss(examples[1], config.loop.per_device_batch_size,
                                            max_batches=runner.eval_batches(config.loop)))
    trainer.deployer.log_info(f"eval perplexity {perplexity:.3f}")
    return perplexity


def add_lm_arguments(parser) -> None:
    """The LM's flags: every pipeline's (``flags.add_arguments``) and its data's."""
    flags.add_arguments(parser)
    parser.add_argument("--block_size", type=int, default=LMData.block_size, help="tokens per example (a "
                        "row of packed documents holds one more)")
    parser.add_argument("--text_column", default=LMData.text_column)
    parser.add_argument("--tokenizer", help="a tokenizer.json (default: --model's)")
    parser.add_argument("--eos_id", type=int, help="a token file's (.bin) end-of-document "
                        "id (default: its manifest's, else config.json's eos_token_id)")
    parser.add_argument("--token_dtype", choices=["uint16", "uint32"], help="the ids' type "
                        "in a token file (default: its manifest's, else uint16)")
    parser.add_argument("--pack", action=BooleanFlag, default=LMData.pack,
                        help="pack a token file's documents into full rows (--no_pack: a "
                        "document a row, padded)")


def load_lm(config: RunConfig[LMData]) -> tuple[nnx.Module, dict]:
    """``(model, its config.json)``: ``--model`` trained, or untrained with ``from_scratch``
    (of its config.json, or a preset sized to the data's vocabulary)."""
    source = config.source
    return runner.load_source(source, config.jax_seed,
                              **scratch_fields(source, config.task, config.data))


def lm_examples(config: RunConfig[LMData], model_config: dict) -> tuple[Sequence, Sequence]:
    """``(train, eval)``: token files with their documents packed into rows
    (``redco_zoo_lm/token_data.py``; without ``--eval``, every 20th row held out), or text cut
    into blocks of ``block_size`` (without ``--eval``, the last 5% of ``--train``), tokenized
    by ``--tokenizer`` or the model's."""
    data, lm = config.data, config.task
    if is_token_data(data.train):
        train = token_rows(data.train, lm, config.jax_seed, model_config)
        return (train, token_rows(data.eval, lm, config.jax_seed, model_config)) if data.eval \
            else hold_out(train)
    tokenizer = runner.load_tokenizer(lm.tokenizer or config.source.model)
    parts = runner.split_eval(data, {"--text_column": lm.text_column})
    return tuple(text_blocks([r[lm.text_column] for r in part], tokenizer, lm.block_size, what)
                 for part, what in zip(parts, ("--train", "--eval (or the last 5% of --train)")))


def scratch_fields(source: ModelSource, lm: LMData, data: Data) -> dict:
    """A preset's field that the data decides: the vocabulary (of ``lm.tokenizer``, else of
    the first token file's manifest)."""
    if not source.from_scratch or os.path.isdir(source.model):
        return {}
    if lm.tokenizer:
        tokenizer = runner.load_tokenizer(lm.tokenizer)
        return {"vocab_size": tokenizer.get_vocab_size()}
    files = token_files(next(iter(parse_sources(data.train)))) if is_token_data(data.train) \
        else []
    manifest = manifest_of(files[0]) if files else {}
    if "vocab_size" not in manifest:
        raise UsageError(f"--model {source.model} --from_scratch: say which vocabulary with "
                         "--tokenizer tokenizer.json (or train on a token file made by redco "
                         "tokenize, whose manifest names it).")
    return {"vocab_size": manifest["vocab_size"]}
