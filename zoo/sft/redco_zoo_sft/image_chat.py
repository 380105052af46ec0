"""Supervised fine-tuning of an image + text model (LLaVA, Gemma 3 with images) on chats whose
messages hold image parts, through the same three functions.

A message's content may be a list of parts, as the HuggingFace and OpenAI chat formats write
them: ``{"type": "text", "text"}``, ``{"type": "image", "path" | "image" | "url"}``,
``{"type": "image_url", "image_url": {"url"}}`` (a local path, ``file://`` or ``data:`` URL;
``redco_zoo_models.image_collate.chat_text_and_images``). Each image part becomes the processor's
placeholder (LLaVA's ``<image>``, Gemma 3's ``<start_of_image>``) where it stands, the parts
joined by newlines, so the chat renders through the tokenizer's template as a text chat does
(``chat.render_chat``: the assistant's tokens found the same way). The model's own processor
then expands each placeholder into the image tokens; the loss mask follows the tokens that
the expansion keeps (a token-level alignment of the two id sequences), the inserted image
tokens never counted.

Chats are not packed (Gemma 3's images see themselves both ways, which packed rows do not
support): one chat a row, right-padded to ``max_len``. Images of any size are resized by the
processor to the tower's fixed size (LLaVA's CLIP, Gemma 3's SigLIP), so ``pixel_values`` has
one shape; each row carries the run's most images per chat, ``K`` (blank images pad the rest,
unused): one shape per run, one compile. What cannot be learned from is refused before
compiling, naming the chat and the fix: an image that cannot be read, placeholders the
template renders other than one per image, image tokens past ``max_len``, an image in an
assistant message.
"""
from __future__ import annotations

import difflib
from typing import Any

import numpy as np

from redco.protocols import UsageError
from redco_zoo_models.image_collate import (  # noqa: F401 (load_processor: the pipelines')
    chat_text_and_images,
    load_processor,
    read_image,
)
from redco_zoo_models.metrics import token_cross_entropy
from redco_zoo_sft.chat import render, render_chat

TOWER = "vision_tower/"  # the param paths frozen unless --train_vision_tower


def render_image_chat(processor, messages: list[dict], max_len: int, where: str,
                      placeholder: str | None = None) -> dict:
    """``{"token_ids", "loss_mask", "images"}`` of one chat: its ids after the processor's
    expansion of the image placeholders, the assistant's tokens marked (module docstring).
    ``placeholder``: what an image part becomes (default: the processor's image token)."""
    tokenizer = processor.tokenizer
    placeholder = placeholder or processor.image_token
    try:
        if any(isinstance(m.get("content"), list) and any(
                isinstance(p, dict) and p.get("type") == "video" for p in m["content"])
                for m in messages):
            raise ValueError(f"{where} holds a video part: the zoo's image + text models are "
                             "fine-tuned on images only; give a video's frames as image parts.")
        chat, sources = chat_text_and_images(messages, placeholder, where)
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        pictures = [read_image(s, where) for s in sources]
    except ValueError as e:
        raise UsageError(str(e)) from None
    text = render(tokenizer, chat, where)
    mark = processor.image_token
    if text.count(mark) != len(pictures):
        raise UsageError(f"{where} has {len(pictures)} images but the chat template renders "
                         f"{text.count(mark)} {mark!r} placeholders: give one "
                         "image part per image and no placeholder in the text, with a template "
                         "that renders text content as it is.")
    plain = render_chat(tokenizer, chat, 1 << 30, where)
    ids = np.asarray(processor(text=[text], images=pictures or None, add_special_tokens=False,
                               return_tensors="np")["input_ids"][0], np.int32)
    if len(ids) > max_len:
        raise UsageError(f"{where} is {len(ids)} tokens with its {len(pictures)} images' tokens, "
                         f"longer than --max_len {max_len}: raise --max_len to at least "
                         f"{len(ids)}, or give fewer images or shorter text.")
    return {"token_ids": ids, "loss_mask": carried_mask(plain, ids, where), "images": sources}


def carried_mask(plain: dict, ids: np.ndarray, where: str) -> np.ndarray:
    """``plain``'s loss mask carried to ``ids`` (the same tokens, image tokens inserted):
    equal tokens keep their mark, inserted ones get none; every marked token must be kept."""
    mask = np.zeros(len(ids), bool)
    matcher = difflib.SequenceMatcher(None, plain["token_ids"].tolist(), ids.tolist(),
                                      autojunk=False)
    for a, b, n in matcher.get_matching_blocks():
        mask[b:b + n] = plain["loss_mask"][a:a + n]
    if mask.sum() != plain["loss_mask"].sum():
        raise UsageError(f"{where}: the processor changed the assistant's tokens when it "
                         "expanded the image placeholders; keep images out of the replies.")
    return mask


def pixel_rows(image_processor, rows: list[list], per_row: int) -> np.ndarray:
    """(rows, per_row, 3, H, W): each row's images through the processor, blank ones after."""
    from PIL import Image
    flat = [p for row in rows for p in row] or [Image.new("RGB", (8, 8))]  # (its shape)
    pixels = np.asarray(image_processor(images=flat, return_tensors="np")["pixel_values"],
                        np.float32)
    out = np.zeros((len(rows), per_row, *pixels.shape[1:]), np.float32)
    at = 0
    for i, row in enumerate(rows):
        out[i, :len(row)] = pixels[at:at + len(row)]
        at += len(row)
    return out


def collate_image_chats(examples: list[dict], image_processor, max_len: int, per_row: int,
                        pad_id: int) -> dict:
    """Rendered chats -> ``input_ids``, ``attention_mask``, ``loss_mask`` (B, max_len), right-
    padded, and ``pixel_values`` (B, per_row, 3, H, W)."""
    batch = token_rows(examples, max_len, pad_id)
    images = [[read_image(s, "a chat") for s in e["images"]] for e in examples]
    batch["pixel_values"] = pixel_rows(image_processor, images, per_row)
    return batch


def token_rows(examples: list[dict], max_len: int, pad_id: int) -> dict:
    """Rendered chats -> ``input_ids``, ``attention_mask``, ``loss_mask`` (B, max_len), right-
    padded."""
    batch = {"input_ids": np.full((len(examples), max_len), pad_id, np.int32),
             "attention_mask": np.zeros((len(examples), max_len), np.int32),
             "loss_mask": np.zeros((len(examples), max_len), bool)}
    for i, e in enumerate(examples):
        n = len(e["token_ids"])
        batch["input_ids"][i, :n], batch["loss_mask"][i, :n] = e["token_ids"], e["loss_mask"]
        batch["attention_mask"][i, :n] = 1
    return batch


def image_loss_fn(rng, state, params, batch, is_training):
    """Mean next-token cross-entropy over the assistant's tokens, each row's images placed at
    its image tokens."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    logits = state.apply_fn(params, ids[:, :-1], mask[:, :-1], batch["pixel_values"])
    return token_cross_entropy(logits, ids[:, 1:], batch["loss_mask"][:, 1:])


def image_chat_rows(processor, rows: list[dict], column: str, max_len: int,
                    what: str, placeholder: str | None = None) -> list[dict[str, Any]]:
    """The chats of ``rows`` (``column``) rendered for an image + text model."""
    return [render_image_chat(processor, row[column], max_len, f"{what} row {i}", placeholder)
            for i, row in enumerate(rows)]
