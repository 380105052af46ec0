"""Supervised fine-tuning of Gemma 4 with images (``redco_zoo_models.gemma4_vision``) on chats
with image parts: what differs from LLaVA's and Gemma 3's (``image_chat.py``, whose rendering
and loss mask are used as they are: each image part becomes the processor's ``<|image|>``,
which it expands to ``<|image>``, one ``<|image|>`` per soft token, ``<image|>``).

Gemma 4's processor keeps each image's aspect: it gives an image as its own patches and their
(x, y) places, padded to the processor's ``max_soft_tokens`` blocks (places (-1, -1) there), so
images differ in patches and soft tokens. The choice here, as Qwen-VL's (``qwen_vl_chat.py``),
is **padding, one bucket a run**: each image's own patches are repadded to ``P``, the most
patches an image of the run (train and eval) has (its soft tokens x ``k^2``), and each row
carries the run's most images per chat, ``K``, blank ones after its own (every place -1: no
soft tokens). ``pixel_values`` is then (B, K, P, features) and ``image_position_ids`` (B, K, P,
2) in every batch, and the train step compiles once whatever the images' sizes. A padded patch
is masked out of the tower's attention and pooling; each row's soft tokens fill its own image
tokens in order, which see each other both ways in the sliding layers
(``Gemma4ForConditionalGeneration.__call__`` on rows, as the serving engine's prefill; the
repadding is the engine's, ``engine_image_buckets.placed_patch_rows``).
"""
from __future__ import annotations

import numpy as np

from redco.protocols import UsageError
from redco_zoo_models.engine_image_buckets import placed_patch_rows
from redco_zoo_models.image_collate import read_image
from redco_zoo_models.metrics import token_cross_entropy
from redco_zoo_sft.image_chat import token_rows

TOWER = "vision_tower/"  # the param paths frozen unless --train_vision_tower


def patches_per_image(examples: list[dict], cfg) -> int:
    """``P``: the most patches an image of ``examples`` has (its longest run of image tokens
    x ``pooling_kernel_size ** 2``)."""
    longest = 1
    for e in examples:
        edges = np.diff(np.concatenate([[0], e["token_ids"] == cfg.image_token_id, [0]]) * 1)
        if (edges == 1).any():
            longest = max(longest, int((np.flatnonzero(edges == -1)
                                        - np.flatnonzero(edges == 1)).max()))
    return longest * cfg.vision.pooling_kernel_size ** 2


def row_images(image_processor, sources: list, patches: int) -> dict | None:
    """One chat's images through the processor (``{"pixel_values", "image_position_ids"}``),
    None without images; refused when an image has more than ``patches`` patches."""
    if not sources:
        return None
    out = image_processor(images=[read_image(s, "a chat") for s in sources], return_tensors="np")
    own = (np.asarray(out["image_position_ids"]) != -1).all(-1).sum(-1)
    if own.max() > patches:
        raise UsageError(f"a chat's images give {own.tolist()} patches, more than the run's "
                         f"{patches}: its images changed since the chats were read.")
    return out


def collate_gemma4_chats(examples: list[dict], image_processor, cfg, max_len: int,
                         per_row: int, patches: int, pad_id: int) -> dict:
    """Rendered chats -> ``input_ids``, ``attention_mask``, ``loss_mask`` (B, max_len), right-
    padded; ``pixel_values`` (B, per_row, patches, features) and ``image_position_ids`` (B,
    per_row, patches, 2), -1 past each image's own patches and on the blank images."""
    batch = token_rows(examples, max_len, pad_id)
    rows = [row_images(image_processor, e["images"], patches) for e in examples]
    batch.update(placed_patch_rows(rows, per_row, patches, 3 * cfg.vision.patch_size ** 2))
    return batch


def gemma4_loss_fn(rng, state, params, batch, is_training):
    """Mean next-token cross-entropy over the assistant's tokens, each row's images placed at
    its image tokens."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    logits = state.apply_fn(params, ids[:, :-1], mask[:, :-1], batch["pixel_values"],
                            batch["image_position_ids"])
    return token_cross_entropy(logits, ids[:, 1:], batch["loss_mask"][:, 1:])
