"""Chat messages with image parts, for ``redco serve`` over an image + text model (LLaVA,
Gemma 3, Gemma 4, Qwen2.5-VL, Qwen3-VL, Qwen3.5, Idefics3/SmolVLM).

An image part is OpenAI's ``{"type": "image_url", "image_url": {"url": "data:image/png;
base64,..."}}`` (or HuggingFace's ``{"type": "image", ...}``); it is decoded on the host
(``redco_zoo_models.image_collate.chat_text_and_images``: the part becomes the processor's
placeholder where it stands, LLaVA's ``<image>``, Qwen's ``<|vision_start|><|image_pad|>
<|vision_end|>``: ``image_placeholder``) and the chat, rendered by the chat template, goes
through the model's own transformers processor, which resizes each image (LLaVA's to the
tower's size, Qwen's to multiples of its patches: their ``pixel_values`` and ``image_grid_thw``;
Gemma 4's to its soft-token budget: padded patches and their ``image_position_ids``;
Idefics3's splits it into tiles of the tower's size plus a global one) and expands its
placeholder into the image tokens. The engine's prefill places the images'
features there (``redco_zoo_models.engine_images``). An image that cannot be read, a web URL,
and an image sent to a text model are a 400 that names the fix.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from redco_serve import openai_api as api
from redco_zoo_models.image_collate import chat_text_and_images, image_placeholder, read_image

IMAGE_PARTS = ("image", "image_url")


def refuse_images(messages) -> None:
    """A 400 when ``messages`` hold an image part: this model reads text only."""
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in
                                             IMAGE_PARTS for p in content):
            raise api.BadRequest("This model reads text only, and the messages hold an image "
                                 "part: send text content, or serve an image + text model "
                                 "(LLaVA, Qwen-VL) with redco serve.", "messages")


def chat_with_images(messages, processor,
                     chat_text: Callable[[list, object], str]) -> tuple[list[int], object]:
    """``(prompt ids, images)`` of a chat whose messages may hold image parts (None without):
    LLaVA's pixels (n, 3, H, W), Qwen's ``{"pixel_values", "image_grid_thw"}``, Gemma 4's
    ``{"pixel_values", "image_position_ids"}``, Idefics3's tiles (tiles, 3, H, W);
    ``chat_text(messages, tokenizer)`` renders the chat (with the generation prompt)."""
    if not isinstance(messages, list):
        raise api.BadRequest("messages: give a non-empty list of {\"role\", \"content\"} "
                             "objects.", "messages")
    try:
        flat, sources = chat_text_and_images(messages, image_placeholder(processor),
                                             "messages")
        pictures = [read_image(s, "messages") for s in sources]
    except ValueError as e:
        raise api.BadRequest(str(e), "messages") from None
    text = chat_text(flat, processor.tokenizer)
    if text.count(processor.image_token) != len(pictures):
        raise api.BadRequest(f"The messages hold {len(pictures)} images, and the chat renders "
                             f"{text.count(processor.image_token)} {processor.image_token!r} "
                             "placeholders: send one image part per image, and no placeholder "
                             "in the text.", "messages")
    out = processor(text=[text], images=pictures or None, add_special_tokens=False,
                    return_tensors="np")
    ids = np.asarray(out["input_ids"][0]).tolist()
    if not pictures:
        return ids, None
    pixels = np.asarray(out["pixel_values"], np.float32)
    if "image_grid_thw" in out:  # (Qwen: patches of each image's own grid)
        return ids, {"pixel_values": pixels, "image_grid_thw": np.asarray(out["image_grid_thw"])}
    if "image_position_ids" in out:  # (Gemma 4: padded patches and their places)
        return ids, {"pixel_values": pixels,
                     "image_position_ids": np.asarray(out["image_position_ids"])}
    if "pixel_attention_mask" in out:  # (Idefics3/SmolVLM: the tiles of one prompt)
        if not np.asarray(out["pixel_attention_mask"]).all():
            raise api.BadRequest("The processor made tiles of another size than the tower's: "
                                 "serve this model with its processor's do_image_splitting "
                                 "on.", "messages")
        return ids, pixels[0]
    return ids, pixels
