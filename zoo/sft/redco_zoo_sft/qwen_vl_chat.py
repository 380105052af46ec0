"""Supervised fine-tuning of Qwen2.5-VL and Qwen3-VL (``redco_zoo_models.qwen_vl``) on chats
with image parts: what differs from LLaVA's (``image_chat.py``, whose rendering and loss mask
are used as they are).

Each image part becomes ``<|vision_start|><|image_pad|><|vision_end|>`` (as Qwen's own chat
template writes one), which the model's processor expands to one ``<|image_pad|>`` per merged
2 x 2 block of the image's patches. The processor keeps each image's size (resized only to
multiples of ``patch_size * merge_size`` pixels, within its ``min_pixels`` and
``max_pixels``), so chats differ in patches. The choice here is **padding, one bucket a
run**: every row's patches (its images' one after another, the processor's ``pixel_values``)
are padded with zeros to ``P``, the most patches a chat of the run (train and eval) has, a
multiple of ``merge_size ** 2``. ``pixel_values`` is then (B, P, features) in every batch and
the train step compiles once, whatever the images' sizes. A padded patch is masked out: its
frame and window ids are -1, so no real patch attends to it (nor it to them), it reads no
learned position (Qwen3-VL's taps weigh 0), and its merged features come after the row's real
ones, which alone fill the row's image tokens (``QwenVLForConditionalGeneration.row_features``).
The cost: a row of small images computes the tower on ``P`` patches; ``max_pixels`` in the
model's ``processor_config.json`` bounds ``P``.

M-RoPE's positions (3 a token) are made on the host when a batch is collated, from its ids and
its images' grids, as transformers' ``get_rope_index`` makes them (``redco_zoo_models.mrope``),
and sent as ``position_ids`` (B, 3, T); the tower's patch layout (rows and columns, frame and
window ids, Qwen3-VL's position-table taps) likewise, one (B, P, ...) array each.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from redco.protocols import UsageError
from redco_zoo_models.image_collate import read_image
from redco_zoo_models.metrics import token_cross_entropy
from redco_zoo_models.mrope import rope_index
from redco_zoo_models.qwen_vl import padded_patches

TOWER = "visual/"  # the param paths frozen unless --train_vision_tower


def placeholder(processor) -> str:
    """What an image part becomes in the rendered chat: the processor's image token between
    the tokenizer's vision start and end tokens."""
    tokenizer = processor.tokenizer
    marks = [getattr(tokenizer, f"vision_{k}_token", None) for k in ("start", "end")]
    if None in marks:
        raise UsageError("the Qwen-VL tokenizer names no vision_start_token and "
                         "vision_end_token (<|vision_start|>, <|vision_end|>): save the "
                         "model's own tokenizer with it.")
    return marks[0] + processor.image_token + marks[1]


def patches_per_row(examples: list[dict], merge: int, image_token: int) -> int:
    """``P``: the most patches a chat of ``examples`` has (its image tokens x ``merge ** 2``)."""
    return max([merge ** 2, *(int(np.sum(e["token_ids"] == image_token)) * merge ** 2
                              for e in examples)])


def row_patches(image_processor, sources: list, cfg, patches: int) -> tuple:
    """One row's ``(pixel_values (P, features), layout {key: (P, ...)}, grids (images, 3))``,
    its images' patches then padding (module docstring; ``qwen_vl.padded_patches``)."""
    if not sources:
        return (*padded_patches(None, np.zeros((0, 3), np.int64), cfg, patches),
                np.zeros((0, 3), np.int64))
    out = image_processor(images=[read_image(s, "a chat") for s in sources], return_tensors="np")
    real, grids = np.asarray(out["pixel_values"], np.float32), np.asarray(out["image_grid_thw"])
    if len(real) > patches:
        raise UsageError(f"a chat's images give {len(real)} patches, more than the run's "
                         f"{patches}: its images changed since the chats were read.")
    return (*padded_patches(real, grids, cfg, patches), grids)


def collate_qwen_chats(examples: list[dict], image_processor, cfg, max_len: int, patches: int,
                       pad_id: int) -> dict:
    """Rendered chats -> ``input_ids``, ``attention_mask``, ``loss_mask`` (B, max_len), right-
    padded; ``position_ids`` (B, 3, max_len); ``pixel_values`` (B, P, features) and the
    layout's arrays as ``layout_<key>`` (B, P, ...)."""
    from redco_zoo_sft.image_chat import token_rows
    batch = token_rows(examples, max_len, pad_id)
    rows = [row_patches(image_processor, e["images"], cfg, patches) for e in examples]
    batch["pixel_values"] = np.stack([r[0] for r in rows])
    for key in rows[0][1]:
        batch[f"layout_{key}"] = np.stack([r[1][key] for r in rows])
    grids = np.concatenate([r[2] for r in rows])
    positions, _ = rope_index(batch["input_ids"], batch["attention_mask"], grids,
                              cfg.image_token_id, cfg.vision.spatial_merge_size)
    batch["position_ids"] = positions.transpose(1, 0, 2)
    return batch


def qwen_loss_fn(rng, state, params, batch, is_training):
    """Mean next-token cross-entropy over the assistant's tokens, each row's images placed at
    its image tokens, every token at its M-RoPE positions."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    layout = {k.removeprefix("layout_"): v for k, v in batch.items() if k.startswith("layout_")}
    positions = jnp.moveaxis(batch["position_ids"], 1, 0)[:, :, :-1]
    logits = state.apply_fn(params, ids[:, :-1], mask[:, :-1], batch["pixel_values"], None,
                            positions, layout)
    return token_cross_entropy(logits, ids[:, 1:], batch["loss_mask"][:, 1:])
