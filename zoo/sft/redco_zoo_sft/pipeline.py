"""Supervised fine-tuning on chats through the three functions, and ``redco zoo run sft``.

Each example is a row of chats packed together (``chat.py``): ``token_ids``, ``segment_ids``
(one id per chat, 0 for padding) and ``loss_mask`` (the assistant's tokens). The loss is the
next-token cross-entropy of the assistant's tokens only, averaged over them: the system's and
the user's tokens are context, never targets, and a chat attends only to itself. ``pred_fn``
samples the assistant's reply after a prompt rendered with the generation prompt.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np

import redco
from redco.protocols import UsageError
from redco_zoo_models import base_plan, flags, generate, runner
from redco_zoo_models.metrics import logits_and_experts, token_cross_entropy, with_experts
from redco_zoo_models.settings import RunConfig
from redco_zoo_sft.chat import pack_chats, render_chat

__all__ = ["collate_fn", "loss_fn", "pred_fn"]


def collate_fn(examples: list[dict]) -> dict:
    """Rows of packed chats -> ``input_ids``, ``segment_ids``, ``loss_mask``, each (B, T)."""
    return {"input_ids": np.stack([e["token_ids"] for e in examples]).astype(np.int32),
            "segment_ids": np.stack([e["segment_ids"] for e in examples]).astype(np.int32),
            "loss_mask": np.stack([e["loss_mask"] for e in examples])}


def loss_fn(rng, state, params, batch, is_training):
    """Mean next-token cross-entropy over the assistant's tokens (module docstring)."""
    ids, segments = batch["input_ids"], batch["segment_ids"]
    logits, experts = logits_and_experts(state.apply_fn, params, ids[:, :-1],
                                         segment_ids=segments[:, :-1])
    counted = batch["loss_mask"][:, 1:] & (segments[:, 1:] == segments[:, :-1])
    return with_experts(token_cross_entropy(logits, ids[:, 1:], counted), experts)


def pred_fn(rng, params, batch, model, max_new_tokens: int = 64, temperature: float = 0.0):
    """``max_new_tokens`` sampled after each prompt row of ``input_ids`` (``temperature`` 0:
    greedy); ``model`` gives the structure, ``params`` its weights."""
    return generate(model, params, batch["input_ids"], max_new_tokens, rng=rng,
                    temperature=temperature)


def load_chat_tokenizer(path: str):
    """The transformers tokenizer saved in ``path`` (a model directory), with its chat
    template; offline."""
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except OSError as e:
        raise UsageError(f"{path}: no tokenizer there that transformers can read "
                         f"(tokenizer.json and tokenizer_config.json): {e}") from e


@dataclasses.dataclass(frozen=True)
class SFTData:
    """An SFT run's own settings (``RunConfig.task``): each row's chat is its
    ``messages_column``, packed with others into rows of ``max_len`` tokens."""
    messages_column: str = "messages"
    max_len: int = 512


def chat_rows(rows: list[dict], tokenizer, data: SFTData, seed: int, what: str) -> list[dict]:
    """The chats of ``rows`` (``data.messages_column``) rendered and packed into rows of
    ``data.max_len`` tokens, in an order drawn from ``seed``."""
    chats = [render_chat(tokenizer, row[data.messages_column], data.max_len, f"{what} row {i}")
             for i, row in enumerate(rows)]
    return pack_chats(chats, data.max_len, seed=seed)


class SFTPipeline:
    description = ("supervised fine-tuning on chats: the tokenizer's chat template, the loss on "
                   "the assistant's tokens, chats packed into rows")

    def add_arguments(self, parser) -> None:
        flags.add_arguments(parser)
        flags.add_training_levers(parser)
        parser.add_argument("--messages_column", default=SFTData.messages_column, help="each row's chat: a "
                            "list of {role, content} messages")
        parser.add_argument("--max_len", type=int, default=SFTData.max_len,
                            help="tokens per packed row")

    def run(self, args) -> float:
        return train_sft(RunConfig.of_flags(args, SFTData))


def train_sft(config: RunConfig[SFTData]) -> float:
    """The whole SFT run of ``config``; returns the held-out loss on the assistant's tokens. A
    quantised base left to the planner is planned first (``redco_zoo_models.base_plan``)."""
    config = base_plan.planned(config, config.task.max_len)
    source = config.source
    tokenizer = load_chat_tokenizer(source.model)
    model, _ = runner.load_source(source, config.jax_seed)
    parts = runner.split_eval(config.data, {"--messages_column": config.task.messages_column})
    train, evaluate = (chat_rows(part, tokenizer, config.task, config.jax_seed, what)
                       for part, what in zip(parts, ("--train",
                                                     "--eval (or the last 5% of --train)")))
    trainer = runner.train_and_eval(config, model, (train, evaluate), collate_fn, loss_fn)
    loss = trainer.eval_loss(evaluate, config.loop.per_device_batch_size,
                             max_batches=runner.eval_batches(config.loop))
    trainer.deployer.log_info(f"eval loss on the assistant's tokens {loss:.4f}")
    return loss


@redco.hookimpl
def register_zoo_pipelines(register):
    register("sft", SFTPipeline())


@redco.hookimpl
def register_templates(register):
    register("sft", os.path.join(os.path.dirname(__file__), "template"))
