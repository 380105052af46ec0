"""LLaVA-OneVision (transformers' ``LlavaOnevisionForConditionalGeneration``) in Flax NNX: LLaVA
(``redco_zoo_models.llava``: the projector, the feature layers) with SigLIP's tower
(``siglip_vision``) and "anyres" images, a Qwen2 (or any zoo decoder) language model.

The processor (``LlavaOnevisionProcessor``) resizes each image to the best of
``image_grid_pinpoints`` (``best_resolution``), pads it, and cuts it into tiles of the tower's
size after a base tile (the whole image resized): ``pixel_values`` (images, max tiles, 3, H, W),
``image_sizes`` (images, 2) the original (height, width), ``batch_num_images`` the images of
each prompt. Every tile runs through the tower and projector; an image that is its prompt's only
one is then packed as transformers does (``Layout``): its base tile's features, then the other
tiles' laid out as one grid, the padding's rows or columns cut off (unpad), bilinearly shrunk
when it holds more than ``anyres_max_N`` tiles' worth (``vision_aspect_ratio``), and
``image_newline`` after each grid row, row by row. An image of a prompt with several is its base
tile and one ``image_newline``. The packing depends on ``image_sizes``: host values (NumPy),
read when the model is called or ``generate`` encodes, not traced arrays.

Each prompt's images' features go to its own image tokens (``image_text``'s per-row placement;
transformers' ``masked_scatter`` gives the same); a prompt whose image tokens are not its
images' features is refused naming both. Not yet: videos (``pixel_values_videos``), the serving
engine and ``redco zoo run sft`` (``unserved``, ``untrained``: refused before compiling).
"""
from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from redco_zoo_models.image_text import ImageTextModel
from redco_zoo_models.llava import LlavaConfig, LlavaForConditionalGeneration
from redco_zoo_models.siglip_vision import SiglipVisionConfig, SiglipVisionModel, without_head

PINPOINTS = tuple((384 * h, 384 * w) for h in range(1, 7) for w in range(1, 7))  # (transformers')
READS = {"image_token_index": 151646, "video_token_index": 151647, "projector_hidden_act": "gelu",
         "vision_feature_select_strategy": "full", "vision_feature_layer": -1,
         "multimodal_projector_bias": True, "image_grid_pinpoints": PINPOINTS,
         "vision_aspect_ratio": "anyres_max_9"}
METADATA = {"model_type", "architectures", "dtype", "torch_dtype", "transformers_version",
            "text_config", "vision_config", "tie_word_embeddings", "ignore_index", "vocab_size",
            "pad_token_id", "use_cache", "image_token_id", "video_token_id"}


@dataclasses.dataclass(frozen=True)
class OnevisionConfig(LlavaConfig):
    vision: SiglipVisionConfig = SiglipVisionConfig()
    image_token_index: int = 151646
    video_token_index: int = 151647  # (kept for the export; videos are not read yet)
    vision_feature_select_strategy: str = "full"
    vision_feature_layer: int | tuple[int, ...] = -1
    image_grid_pinpoints: tuple[tuple[int, int], ...] = PINPOINTS
    vision_aspect_ratio: str = "anyres_max_9"

    MODEL_TYPE, ARCHITECTURE = "llava_onevision", "LlavaOnevisionForConditionalGeneration"
    TEXT_TYPE, HF_READS, HF_METADATA, VISION = "qwen2", READS, METADATA, SiglipVisionConfig

    def __post_init__(self):
        super().__post_init__()
        if self.vision_feature_select_strategy != "full":
            raise ValueError("vision_feature_select_strategy 'default' drops the first patch of "
                             "every tile (SigLIP has no class token), which breaks the tiles' "
                             "grid (transformers raises on it too): use 'full'.")
        if not re.fullmatch(r"anyres_max_[1-9][0-9]*", self.vision_aspect_ratio):
            raise ValueError(f"vision_aspect_ratio {self.vision_aspect_ratio!r}: the zoo reads "
                             "'anyres_max_N'.")
        tile = self.vision.image_size
        if any(h % tile or w % tile for h, w in self.image_grid_pinpoints):
            raise ValueError(f"image_grid_pinpoints {self.image_grid_pinpoints}: each must be "
                             f"a multiple of the tower's image_size {tile}.")

    def max_tiles(self) -> int:
        """``vision_aspect_ratio``'s N: the tiles' worth of features an image keeps."""
        return int(self.vision_aspect_ratio.rpartition("_")[2])


def best_resolution(size, pinpoints) -> tuple[int, int]:
    """The pinpoint (height, width) an image of ``size`` (height, width) is resized to: the most
    of its pixels kept, then the least wasted (transformers' ``select_best_resolution``)."""
    height, width = size
    best, kept_most, wasted_least = None, 0, float("inf")
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        if kept > kept_most or (kept == kept_most and h * w - kept < wasted_least):
            best, kept_most, wasted_least = (h, w), kept, h * w - kept
    return best


def resize_matrix(n_in: int, n_out: int) -> np.ndarray:
    """(n_out, n_in): torch's bilinear ``interpolate`` along one axis (``align_corners=False``,
    no antialiasing)."""
    src = np.maximum((np.arange(n_out) + 0.5) * (n_in / n_out) - 0.5, 0.0)
    low = src.astype(np.int64)
    high = np.minimum(low + 1, n_in - 1)
    out = np.zeros((n_out, n_in), np.float32)
    np.add.at(out, (np.arange(n_out), low), 1.0 - (src - low))
    np.add.at(out, (np.arange(n_out), high), src - low)
    return out


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one image's tiles are packed: ``grid`` (rows, columns) of tiles after the base one
    (None: the base tile alone), the grid's patches kept ``rows`` and ``cols`` (start, stop),
    and the size it is shrunk to (None: kept)."""
    tiles: int
    grid: tuple[int, int] | None = None
    rows: tuple[int, int] = (0, 0)
    cols: tuple[int, int] = (0, 0)
    shrunk: tuple[int, int] | None = None

    @classmethod
    def of(cls, cfg: OnevisionConfig, size, tiled: bool) -> "Layout":
        """The layout of an image of ``size`` (height, width); ``tiled``: its prompt's only one."""
        if not tiled:
            return cls(1)
        tile, side = cfg.vision.image_size, cfg.vision.image_size // cfg.vision.patch_size
        grid = tuple(n // tile for n in best_resolution(size, cfg.image_grid_pinpoints))
        height, width = (n * side for n in grid)
        rows, cols = (0, height), (0, width)
        if size[1] / size[0] > width / height:  # (transformers' unpad_image)
            pad = (height - int(round(size[0] * (width / size[1]), 7))) // 2
            rows = (pad, height - pad)
        else:
            pad = (width - int(round(size[1] * (height / size[0]), 7))) // 2
            cols = (pad, width - pad)
        h, w = rows[1] - rows[0], cols[1] - cols[0]
        ratio = math.sqrt(h * w / (cfg.max_tiles() * side ** 2))
        shrunk = (int(h // ratio), int(w // ratio)) if ratio > 1.1 else None
        return cls(1 + grid[0] * grid[1], grid, rows, cols, shrunk)

    def features(self, side: int) -> int:
        """The features this image packs to (its image tokens)."""
        if self.grid is None:
            return side * side + 1
        h, w = self.shrunk or (self.rows[1] - self.rows[0], self.cols[1] - self.cols[0])
        return side * side + h * (w + 1)


class LlavaOnevisionForConditionalGeneration(LlavaForConditionalGeneration):
    """``__call__(input_ids, attention_mask, pixel_values, image_sizes, batch_num_images)``:
    logits (B, T, vocab); ``encode(pixel_values, image_sizes, batch_num_images)``: the context
    ``generate`` places at the prompts' image tokens."""
    config_class = OnevisionConfig
    tower = SiglipVisionModel

    def __init__(self, cfg: OnevisionConfig, rngs: nnx.Rngs):
        super().__init__(cfg, rngs)
        self.image_newline = nnx.Param(
            cfg.text.hidden_size ** -0.5 * jax.random.normal(rngs.params(), (cfg.text.hidden_size,)))

    def layouts(self, image_sizes, batch_num_images=None) -> list[list[Layout]]:
        """Each prompt's images' layouts (``batch_num_images`` None: one image a prompt)."""
        if isinstance(image_sizes, jax.core.Tracer) or isinstance(batch_num_images,
                                                                    jax.core.Tracer):
            raise ValueError("image_sizes and batch_num_images decide the packing of the tiles: "
                             "pass them as host arrays (NumPy), outside jax.jit's arguments.")
        sizes = np.asarray(image_sizes).tolist()
        counts = [1] * len(sizes) if batch_num_images is None else np.asarray(
            batch_num_images).tolist()
        if sum(counts) != len(sizes):
            raise ValueError(f"batch_num_images {counts} count {sum(counts)} images; "
                             f"image_sizes give {len(sizes)}.")
        starts = np.cumsum([0, *counts])
        return [[Layout.of(self.cfg, size, n == 1) for size in sizes[a:a + n]]
                for a, n in zip(starts, counts)]

    def encode(self, pixel_values, image_sizes=None, batch_num_images=None):
        """``(features (prompts, most features, hidden), each prompt's count)``: its images'
        packed features in order, zeros past them. ``pixel_values`` (images, tiles, 3, H, W),
        as the processor pads them, or (all tiles, 3, H, W)."""
        if image_sizes is None:
            raise ValueError("LLaVA-OneVision needs image_sizes (the processor's) with "
                             "pixel_values: its tiles' packing depends on them.")
        prompts = self.layouts(image_sizes, batch_num_images)
        flat = [layout for images in prompts for layout in images]
        tiles = pixel_values
        if pixel_values.ndim == 5:
            index = [(i, t) for i, layout in enumerate(flat) for t in range(layout.tiles)]
            tiles = pixel_values[tuple(np.array(index).T)]
        if len(tiles) != sum(layout.tiles for layout in flat):
            raise ValueError(f"pixel_values hold {len(tiles)} tiles; image_sizes' images "
                             f"need {sum(layout.tiles for layout in flat)}.")
        features = super().encode(tiles)
        starts = np.cumsum([0, *(layout.tiles for layout in flat)])
        packed = [self.pack(features[a:a + layout.tiles], layout)
                  for a, layout in zip(starts, flat)]
        rows, counts, at = [], [], 0
        for images in prompts:
            rows.append(jnp.concatenate(packed[at:at + len(images)]))
            counts.append(len(rows[-1]))
            at += len(images)
        longest = max(counts)
        return (jnp.stack([jnp.pad(r, ((0, longest - len(r)), (0, 0))) for r in rows]),
                np.array(counts))

    def pack(self, tiles, layout: Layout):
        """One image's tile features (tiles, side * side, hidden) packed (module docstring)."""
        newline = self.image_newline[...].astype(tiles.dtype)
        if layout.grid is None:
            return jnp.concatenate([tiles[0], newline[None]])
        side, d = self.cfg.vision.image_size // self.cfg.vision.patch_size, tiles.shape[-1]
        (gh, gw), (top, bottom), (left, right) = layout.grid, layout.rows, layout.cols
        grid = tiles[1:].reshape(gh, gw, side, side, d).transpose(0, 2, 1, 3, 4)
        grid = grid.reshape(gh * side, gw * side, d)[top:bottom, left:right]
        if layout.shrunk is not None:
            (h, w), (n, m) = layout.shrunk, grid.shape[:2]
            grid = jnp.einsum("ph,hwd,qw->pqd", resize_matrix(n, h), grid, resize_matrix(m, w),
                              precision="highest")
        grid = jnp.concatenate([grid, jnp.broadcast_to(newline, (len(grid), 1, d))], 1)
        return jnp.concatenate([tiles[0], grid.reshape(-1, d)])

    def check_inputs(self, input_ids, counts) -> None:
        """Refuse prompts whose image tokens are not their images' ``counts`` of features (in
        order over the prompts with image tokens); skipped for traced ``input_ids``."""
        if isinstance(input_ids, jax.core.Tracer) or isinstance(counts, jax.core.Tracer):
            return
        token = self.cfg.image_token_index
        found = np.sum(np.asarray(input_ids) == token, axis=1)
        if found[found > 0].tolist() != np.asarray(counts).tolist():
            raise ValueError(
                f"the prompts hold {found.tolist()} image tokens (id {token}); their images "
                f"pack to {np.asarray(counts).tolist()} features (by image_sizes): build the "
                "prompts with the model's processor, from the same images.")

    def embed_images(self, input_ids, context):
        """The decoder's input embeddings, ``context`` (``encode``'s) placed."""
        features, counts = (None, np.zeros(0, int)) if context is None else context
        self.check_inputs(input_ids, counts)
        x = self.language_model.model.embed(input_ids)
        if features is None:
            return x
        has_images = (input_ids == self.cfg.image_token_index).any(1)
        prompt = jnp.clip(jnp.cumsum(has_images) - 1, 0, len(features) - 1)
        return self.place(input_ids, features[prompt], x, per_row=True)

    def __call__(self, input_ids, attention_mask=None, pixel_values=None, image_sizes=None,
                 batch_num_images=None, cache=None, cache_index=0, labels=None,
                 label_mask=None, pixel_values_videos=None):
        """As ``ImageTextModel.__call__``, the images given as the processor gives them."""
        if pixel_values_videos is not None:
            raise NotImplementedError("LLaVA-OneVision's videos (pixel_values_videos) are not "
                                      "read yet: send each frame as an image.")
        context = None if pixel_values is None else self.encode(pixel_values, image_sizes,
                                                                batch_num_images)
        return self.language_model(input_ids, attention_mask, cache, cache_index, labels=labels,
                                   label_mask=label_mask,
                                   inputs_embeds=self.embed_images(input_ids, context))

    def decode(self, ids, key_valid, cache, cache_index, context=None):
        """One generation step; ``context`` (``encode``'s) placed when the prompt is read."""
        if isinstance(cache_index, int) and cache_index == 0:
            embeds = self.embed_images(ids, context)
        else:
            embeds = self.language_model.model.embed(ids)
        return self.language_model(ids, key_valid, cache, cache_index, inputs_embeds=embeds)

    def unserved(self) -> str | None:
        return ("LlavaOnevisionForConditionalGeneration: its images are tiled by size "
                "(image_sizes), which the serving engine's prefill does not pack yet; "
                "generate() with encoder_inputs={'pixel_values': ..., 'image_sizes': ..., "
                "'batch_num_images': ...} instead.")

    def untrained(self) -> str | None:
        return ("LLaVA-OneVision's images are tiled by size (image_sizes), which the SFT "
                "pipeline's collate and jitted step do not pack yet; fine-tune LLaVA, Gemma 3 or "
                "Qwen2.5-VL there, or this model through your own loop (model(..., image_sizes=).")

    def hf_tensors_in(self, tensors: dict) -> dict:
        """As ``ImageTextModel``'s, without SigLIP's pooling head (OneVision does not use it)."""
        return ImageTextModel.hf_tensors_in(self, without_head(
            {re.sub(r"^model\.image_newline$", "image_newline", k): v
             for k, v in tensors.items()}))
