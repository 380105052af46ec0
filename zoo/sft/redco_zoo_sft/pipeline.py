"""Supervised fine-tuning on chats through the three functions, and ``redco zoo run sft``.

Each example is a row of chats packed together (``chat.py``): ``token_ids``, ``segment_ids``
(one id per chat, 0 for padding) and ``loss_mask`` (the assistant's tokens). The loss is the
next-token cross-entropy of the assistant's tokens only, averaged over them: the system's and
the user's tokens are context, never targets, and a chat attends only to itself. ``pred_fn``
samples the assistant's reply after a prompt rendered with the generation prompt. An image +
text model's chats (messages with image parts) go through ``image_chat.py`` (Qwen2.5-VL's and
Qwen3-VL's, whose images keep their sizes, through ``qwen_vl_chat.py`` too; Gemma 4's, whose
images keep their aspects, through ``gemma4_chat.py``).
"""
from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import numpy as np

from redco.protocols import UsageError
from redco_zoo_models import base_plan, flags, generate, runner
from redco_zoo_models.image_text import ImageTextModel
from redco_zoo_models.metrics import logits_and_experts, token_cross_entropy, with_experts
from redco_zoo_models.qwen_vl import QwenVLForConditionalGeneration
from redco_zoo_models.settings import RunConfig
from redco_zoo_sft import gemma4_chat, qwen_vl_chat
from redco_zoo_sft.chat import pack_chats, render_chat
from redco_zoo_sft.image_chat import (
    TOWER,
    collate_image_chats,
    image_chat_rows,
    image_loss_fn,
    load_processor,
)
from redco_zoo_sft.plugin import DESCRIPTION

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
    ``messages_column``, packed with others into rows of ``max_len`` tokens (an image + text
    model's: one a row, ``image_chat``), its tower trained with ``train_vision_tower``."""
    messages_column: str = "messages"
    max_len: int = 512
    train_vision_tower: bool = False


def chat_rows(rows: list[dict], tokenizer, data: SFTData, seed: int, what: str) -> list[dict]:
    """The chats of ``rows`` (``data.messages_column``) rendered and packed into rows of
    ``data.max_len`` tokens, in an order drawn from ``seed``."""
    chats = [render_chat(tokenizer, row[data.messages_column], data.max_len, f"{what} row {i}")
             for i, row in enumerate(rows)]
    return pack_chats(chats, data.max_len, seed=seed)


class SFTPipeline:
    description = DESCRIPTION

    def add_arguments(self, parser) -> None:
        flags.add_arguments(parser)
        flags.add_training_levers(parser)
        parser.add_argument("--messages_column", default=SFTData.messages_column, help="each row's chat: a "
                            "list of {role, content} messages")
        parser.add_argument("--max_len", type=int, default=SFTData.max_len,
                            help="tokens per packed row")
        parser.add_argument("--train_vision_tower", action="store_true", help="an image + "
                            "text model's vision tower trains too (LoRA: adapters there too); "
                            "default: frozen, the projector and language model train")

    def run(self, args) -> float:
        return train_sft(RunConfig.of_flags(args, SFTData))


def train_sft(config: RunConfig[SFTData]) -> float:
    """The whole SFT run of ``config``; returns the held-out loss on the assistant's tokens. A
    quantised base left to the planner is planned first (``redco_zoo_models.base_plan``)."""
    config = base_plan.planned(config, config.task.max_len)
    source = config.source
    model, _ = runner.load_source(source, config.jax_seed)
    parts = runner.split_eval(config.data, {"--messages_column": config.task.messages_column})
    names = ("--train", "--eval (or the last 5% of --train)")
    if isinstance(model, ImageTextModel):
        trainer, evaluate = train_images(config, model, parts, names)
    elif config.task.train_vision_tower:
        raise UsageError(f"--train_vision_tower: --model {source.model} is a text model "
                         f"({type(model).__name__}), it has no vision tower; drop the flag.")
    else:
        refuse_image_chats(parts, config.task.messages_column, source.model, model)
        tokenizer = load_chat_tokenizer(source.model)
        train, evaluate = (chat_rows(part, tokenizer, config.task, config.jax_seed, what)
                           for part, what in zip(parts, names))
        trainer = runner.train_and_eval(config, model, (train, evaluate), collate_fn, loss_fn)
    loss = trainer.eval_loss(evaluate, config.loop.per_device_batch_size,
                             max_batches=runner.eval_batches(config.loop))
    trainer.deployer.log_info(f"eval loss on the assistant's tokens {loss:.4f}")
    return loss


def refuse_image_chats(parts: tuple[list, list], column: str, where: str, model) -> None:
    """Refuse a text model's chats that hold image parts (it would read each image as its
    placeholder's text), before anything compiles; a multimodal checkpoint the zoo reads as its
    language model here (Llama 4's, Gemma 4's, Qwen3.5's) is one."""
    for rows in parts:
        for row in rows:
            for message in row[column] if isinstance(row[column], list) else ():
                content = message.get("content") if isinstance(message, dict) else None
                if isinstance(content, list) and any(
                        not (isinstance(p, dict) and p.get("type") == "text") for p in content):
                    raise UsageError(
                        f"--model {where} is read as a text model ({type(model).__name__}) and "
                        "the chats hold image parts, which it would read as text: give an "
                        "image + text model `redco zoo run sft` trains (LLaVA, Gemma 3, "
                        "Gemma 4, Qwen2.5-VL, Qwen3-VL), or chats of text alone.")


def train_images(config: RunConfig[SFTData], model, parts: tuple[list, list],
                 names: tuple[str, str]) -> tuple[Any, list]:
    """An image + text model trained on ``parts`` (``image_chat``): ``(trainer, eval rows)``."""
    if why := model.untrained():
        raise UsageError(f"--model {config.source.model}: {why}")
    data = config.task
    processor = load_processor(config.source.model)
    qwen = isinstance(model, QwenVLForConditionalGeneration)
    mark = qwen_vl_chat.placeholder(processor) if qwen else None
    train, evaluate = (image_chat_rows(processor, part, data.messages_column, data.max_len, what,
                                       mark) for part, what in zip(parts, names))
    collate, loss, tower = image_collate(model, processor, train + evaluate, data.max_len)
    frozen = None if data.train_vision_tower else tower
    return runner.train_and_eval(config, model, (train, evaluate), collate, loss,
                                 frozen=frozen), evaluate


def image_collate(model, processor, chats: list[dict], max_len: int) -> tuple:
    """``(collate_fn, loss_fn, tower's param prefix)`` of ``model``'s rendered ``chats``, their
    shapes fixed for the run: Qwen-VL's padded patches (``qwen_vl_chat``), Gemma 4's placed
    patches (``gemma4_chat``), or the fixed-size images of the others (``image_chat``)."""
    pad_id = processor.tokenizer.pad_token_id or 0
    per_row = max([1, *(len(c["images"]) for c in chats)])
    if isinstance(model, QwenVLForConditionalGeneration):  # (images of any size)
        patches = qwen_vl_chat.patches_per_row(chats, model.cfg.vision.spatial_merge_size,
                                               model.cfg.image_token_id)
        return partial(qwen_vl_chat.collate_qwen_chats, cfg=model.cfg, patches=patches,
                       image_processor=processor.image_processor, max_len=max_len,
                       pad_id=pad_id), qwen_vl_chat.qwen_loss_fn, qwen_vl_chat.TOWER
    if getattr(model, "placed_patches", False):  # (Gemma 4: images of any aspect)
        return partial(gemma4_chat.collate_gemma4_chats, cfg=model.cfg, per_row=per_row,
                       patches=gemma4_chat.patches_per_image(chats, model.cfg),
                       image_processor=processor.image_processor, max_len=max_len,
                       pad_id=pad_id), gemma4_chat.gemma4_loss_fn, gemma4_chat.TOWER
    return partial(collate_image_chats, image_processor=processor.image_processor,
                   max_len=max_len, per_row=per_row, pad_id=pad_id), image_loss_fn, TOWER
