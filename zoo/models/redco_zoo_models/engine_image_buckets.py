"""The serving engine's image slots for the families whose images arrive at their own sizes
(``redco_zoo_models.engine_images`` picks them, and says what every image model's prefill
shares): each padded to one bucket, so that no image size compiles a new prefill.

Qwen2.5-VL, Qwen3-VL and Qwen3.5 (dynamic resolution: ``PatchSlots``) take each image at its
own size: a request's images are the processor's ``pixel_values`` patches and
``image_grid_thw``, padded in the prefill to ``max_image_patches`` a prompt (one bucket: one
shape whatever the sizes; the padded patches masked, ``qwen_vl.padded_patches``), more refused
naming the option. The prompt's M-RoPE positions and its delta are made on the host
(``mrope.rope_index``); the prefill places the features (and Qwen3-VL's DeepStack ones) and
keeps the delta in the row's cache, where the decode steps read it.

Gemma 4 (``PlacedPatchSlots``) takes each image at its own aspect too: a request's images are
its processor's ``pixel_values`` (images, patches, features) and ``image_position_ids``
(images, patches, 2; (-1, -1) on padding). The prefill takes ``max_images`` images a prompt,
each image's own patches padded to ``max_image_patches`` (one bucket: the processor's
``max_soft_tokens`` or an image's size changes no shape; an image of more patches is refused
naming the option); the tower encodes each, the row takes its soft tokens in order, and its
image blocks see themselves both ways in the sliding layers (``Gemma4ForConditionalGeneration
.decode``).

Idefics3 and SmolVLM (``TileSlots``) take an image as its processor's tiles (each image's split
tiles and its global one, each of the tower's size; the processor's all-zero padding tiles
dropped): ``max_images`` counts tiles there (an image split 4 x 4 is 17), a prompt of more
refused naming it. The prefill carries that many tile slots a prompt (blank past its own, whose
features no image token takes) and each row's image tokens take its own tiles' features in
order (``ImageTextModel.decode``).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from redco_zoo_models.mrope import rope_index


@dataclasses.dataclass(frozen=True)
class PatchSlots:
    """A Qwen-VL model's prompts (module docstring): up to ``max_images`` images whose patches
    (all of a prompt's) are padded to ``patches``. A request's images: ``{"pixel_values"
    (n, features), "image_grid_thw" (images, 3)}`` from the model's processor."""
    cfg: Any
    max_images: int
    patches: int

    def check(self, prompt: list[int], images) -> None:
        """Refuse ``images`` that ``prompt`` cannot take, naming the fix."""
        if images is None:
            images = {"pixel_values": np.zeros((0, 1)), "image_grid_thw": np.zeros((0, 3))}
        if not isinstance(images, dict) or {"pixel_values", "image_grid_thw"} - set(images):
            raise ValueError("This model's images are its processor's patches: give "
                             "{'pixel_values', 'image_grid_thw'} as the processor returns them.")
        if self.cfg.video_token_id in prompt:
            raise ValueError(f"The prompt holds video tokens (id {self.cfg.video_token_id}); "
                             "the engine reads images, not videos: send each frame as an image.")
        pixels, grids = np.asarray(images["pixel_values"]), np.asarray(images["image_grid_thw"])
        width = self.cfg.vision.patch_features()
        if len(grids) > self.max_images:
            raise ValueError(f"The prompt has {len(grids)} images; this engine takes at most "
                             f"{self.max_images} a prompt: send fewer, or start it with a "
                             "larger max_images.")
        if len(pixels) != int(np.prod(grids, -1).sum()) or len(pixels) and \
                pixels.shape[1:] != (width,):
            raise ValueError(f"The images' patches are {pixels.shape}, not the {grids.tolist()} "
                             f"grids' patches of {width} features: make them with the model's "
                             "processor.")
        if len(pixels) > self.patches:
            raise ValueError(f"The prompt's images give {len(pixels)} patches; this engine pads "
                             f"a prompt's to {self.patches}: send smaller images, or start it "
                             "with a larger max_image_patches (redco serve "
                             "--max_image_patches).")
        rope_index(np.asarray([prompt]), None, grids, self.cfg.image_token_id,
                   self.cfg.vision.spatial_merge_size)  # (image tokens that are not the grids')

    def context(self, requests: list, ids: np.ndarray) -> dict:
        """The prefill's ``context`` (``QwenVLForConditionalGeneration.decode``): each prompt's
        padded patches and layout, its M-RoPE positions (3, count, width) and delta."""
        from redco_zoo_models.qwen_vl import padded_patches
        rows, grids = [], []
        for i in range(len(ids)):
            images = requests[i].images if i < len(requests) else None
            grid = np.zeros((0, 3), np.int64) if images is None else \
                np.asarray(images["image_grid_thw"])
            rows.append(padded_patches(None if images is None else images["pixel_values"],
                                       grid, self.cfg, self.patches))
            grids.append(grid)
        mask = np.arange(ids.shape[1]) < np.array(
            [len(r.prompt) for r in requests] + [0] * (len(ids) - len(requests)))[:, None]
        positions, deltas = rope_index(ids, mask, np.concatenate(grids),
                                       self.cfg.image_token_id,
                                       self.cfg.vision.spatial_merge_size)
        return {"pixels": np.stack([r[0] for r in rows]), "positions": positions,
                "layout": {k: np.stack([r[1][k] for r in rows]) for k in rows[0][1]},
                "deltas": deltas}


@dataclasses.dataclass(frozen=True)
class PlacedPatchSlots:
    """Gemma 4's prompts (module docstring): up to ``max_images`` images, each one's own
    patches padded to ``patches``. A request's images: ``{"pixel_values" (n, patches,
    features), "image_position_ids" (n, patches, 2)}`` from the model's processor."""
    cfg: Any
    max_images: int
    patches: int

    def check(self, prompt: list[int], images) -> None:
        """Refuse ``images`` that ``prompt`` cannot take, naming the fix."""
        if images is None:
            images = {"pixel_values": np.zeros((0, 0, 1)), "image_position_ids":
                      np.zeros((0, 0, 2))}
        if not isinstance(images, dict) or {"pixel_values", "image_position_ids"} - set(images):
            raise ValueError("This model's images are its processor's patches: give "
                             "{'pixel_values', 'image_position_ids'} as the processor returns "
                             "them.")
        pixels = np.asarray(images["pixel_values"])
        places = np.asarray(images["image_position_ids"])
        width = 3 * self.cfg.vision.patch_size ** 2
        if len(places) > self.max_images:
            raise ValueError(f"The prompt has {len(places)} images; this engine takes at most "
                             f"{self.max_images} a prompt: send fewer, or start it with a "
                             "larger max_images.")
        if pixels.shape[:2] != places.shape[:2] or len(pixels) and pixels.shape[2] != width \
                or places.shape[2:] != (2,):
            raise ValueError(f"The images' patches are {pixels.shape} at places {places.shape}, "
                             f"not (images, patches, {width}) at (images, patches, 2): make "
                             "them with the model's processor.")
        own = (places != -1).all(-1).sum(-1)
        if own.size and own.max() > self.patches:
            raise ValueError(f"The prompt's images give {own.tolist()} patches; this engine "
                             f"pads an image's to {self.patches}: send smaller images, or start "
                             "it with a larger max_image_patches (redco serve "
                             "--max_image_patches).")
        soft = int((own // self.cfg.vision.pooling_kernel_size ** 2).sum())
        found = sum(t == self.cfg.image_token_id for t in prompt)
        if found != soft:
            raise ValueError(f"The prompt holds {found} image tokens (id "
                             f"{self.cfg.image_token_id}) but its images give {soft} soft "
                             "tokens: build it with the model's processor.")

    def context(self, requests: list, ids: np.ndarray) -> dict:
        """The prefill's ``context`` (``Gemma4ForConditionalGeneration.decode``): each prompt's
        images' own patches (P, K, patches, features) and places (P, K, patches, 2), -1 past
        them and on the blank images (``placed_patch_rows``)."""
        rows = [r.images for r in requests] + [None] * (len(ids) - len(requests))
        return placed_patch_rows(rows, self.max_images, self.patches,
                                 3 * self.cfg.vision.patch_size ** 2)


def placed_patch_rows(rows: list, k: int, patches: int, width: int) -> dict:
    """Gemma 4's images of each row (None, or the processor's ``{"pixel_values" (n, any,
    width), "image_position_ids" (n, any, 2)}``), each image's own patches (places not -1)
    repadded to ``patches``: ``pixel_values`` (rows, k, patches, width) and
    ``image_position_ids`` (rows, k, patches, 2), -1 past them and on the blank images (the
    serving engine's prefill; the SFT collate, ``redco_zoo_sft.gemma4_chat``)."""
    pixels = np.zeros((len(rows), k, patches, width), np.float32)
    places = np.full((len(rows), k, patches, 2), -1, np.int32)
    for i, images in enumerate(rows):
        if images is None:
            continue
        for j, (image, where) in enumerate(zip(images["pixel_values"],
                                               images["image_position_ids"])):
            own = (np.asarray(where) != -1).all(-1)
            n = int(own.sum())
            pixels[i, j, :n], places[i, j, :n] = np.asarray(image)[own], np.asarray(where)[own]
    return {"pixel_values": pixels, "image_position_ids": places}


@dataclasses.dataclass(frozen=True)
class TileSlots:
    """Idefics3's prompts (module docstring): up to ``shape[0]`` tiles (K, 3, H, W) a prompt,
    ``per_image`` image tokens a tile. A request's images: its processor's ``pixel_values``
    ((1, tiles, 3, H, W) or (tiles, 3, H, W), all-zero padding tiles dropped)."""
    shape: tuple[int, ...]
    token: int
    per_image: int

    @staticmethod
    def tiles(images) -> np.ndarray:
        """The real tiles (n, 3, H, W) of a request's ``images`` (none: (0, ...))."""
        if images is None:
            return np.zeros((0, 3, 1, 1), np.float32)
        pixels = np.asarray(images, np.float32)
        pixels = pixels.reshape(-1, *pixels.shape[-3:])
        return pixels[pixels.reshape(len(pixels), -1).any(-1)]

    def check(self, prompt: list[int], images) -> None:
        """Refuse ``images`` that ``prompt`` cannot take, naming the fix."""
        if images is not None and np.ndim(images) not in (4, 5):
            raise ValueError("This model's images are its processor's tiles: give its "
                             "pixel_values (1, tiles, 3, H, W).")
        tiles = self.tiles(images)
        if len(tiles) > self.shape[0]:
            raise ValueError(f"The prompt's images give {len(tiles)} tiles; this engine takes "
                             f"at most {self.shape[0]} a prompt (Idefics3/SmolVLM: max_images "
                             "counts tiles): send fewer or smaller images, or start it with a "
                             f"larger max_images (redco serve --max_images {len(tiles)}).")
        if len(tiles) and tiles.shape[1:] != self.shape[1:]:
            raise ValueError(f"The tiles are {tiles.shape[1:]}, not the tower's "
                             f"{self.shape[1:]}: make them with the model's processor "
                             "(do_image_splitting=True).")
        found = sum(t == self.token for t in prompt)
        if found != len(tiles) * self.per_image:
            raise ValueError(f"The prompt holds {found} image tokens (id {self.token}) for "
                             f"{len(tiles)} tiles x {self.per_image}: build it with the model's "
                             "processor, from the same images.")

    def context(self, requests: list, ids: np.ndarray) -> np.ndarray:
        """(count, K, 3, H, W): each prompt's tiles in order in its first slots, blank after."""
        out = np.zeros((len(ids), *self.shape), np.float32)
        for i, request in enumerate(requests):
            tiles = self.tiles(request.images)
            out[i, :len(tiles)] = tiles
        return out
