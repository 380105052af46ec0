"""Supervised fine-tuning on chats through the three functions, and ``redco zoo run sft``.

Each example is a row of chats packed together (``chat.py``): ``token_ids``, ``segment_ids``
(one id per chat, 0 for padding) and ``loss_mask`` (the assistant's tokens). The loss is the
next-token cross-entropy of the assistant's tokens only, averaged over them: the system's and
the user's tokens are context, never targets, and a chat attends only to itself. ``pred_fn``
samples the assistant's reply after a prompt rendered with the generation prompt.
"""
from __future__ import annotations

import os

import numpy as np

import redco
from redco.protocols import UsageError
from redco_zoo_models import generate, runner
from redco_zoo_models.metrics import logits_and_experts, token_cross_entropy, with_experts
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


def chat_rows(rows: list[dict], tokenizer, args, what: str) -> list[dict]:
    """The chats of ``rows`` (``--messages_column``) rendered and packed into rows of
    ``--max_len`` tokens."""
    chats = [render_chat(tokenizer, row[args.messages_column], args.max_len, f"{what} row {i}")
             for i, row in enumerate(rows)]
    return pack_chats(chats, args.max_len, seed=args.jax_seed)


class SFTPipeline:
    description = ("supervised fine-tuning on chats: the tokenizer's chat template, the loss on "
                   "the assistant's tokens, chats packed into rows")

    def add_arguments(self, parser) -> None:
        runner.add_arguments(parser)
        runner.add_training_levers(parser)
        parser.add_argument("--messages_column", default="messages", help="each row's chat: a "
                            "list of {role, content} messages")
        parser.add_argument("--max_len", type=int, default=512, help="tokens per packed row")

    def run(self, args) -> float:
        tokenizer = load_chat_tokenizer(args.model)
        model, _ = runner.load_model(args.model, args.from_scratch, args.jax_seed)
        parts = runner.split_eval(args, {"--messages_column": args.messages_column})
        train, evaluate = (chat_rows(part, tokenizer, args, what) for part, what in
                           zip(parts, ("--train", "--eval (or the last 5% of --train)")))
        trainer = runner.train_and_eval(args, model, (train, evaluate), collate_fn, loss_fn)
        loss = trainer.eval_loss(evaluate, args.per_device_batch_size,
                                 max_batches=runner.eval_batches(args))
        trainer.deployer.log_info(f"eval loss on the assistant's tokens {loss:.4f}")
        return loss


@redco.hookimpl
def register_zoo_pipelines(register):
    register("sft", SFTPipeline())


@redco.hookimpl
def register_templates(register):
    register("sft", os.path.join(os.path.dirname(__file__), "template"))
