"""Images in the serving engine (``redco_zoo_models.engine``): an image + text model's prompts
carry their images' pixels, which the prefill encodes and places at the prompt's image tokens
(``ImageTextModel.decode`` given each prompt's images (P, K, 3, H, W)); decoding is as for
text.

Every prefill of an image model carries ``K = max_images`` image slots a prompt (blank where a
prompt has fewer, unused), so its shapes are those of a text model's prefill: nothing compiles
per image count. A prompt is read whole from slot 0 (its image tokens cannot be split over
chunks nor matched as a cached prefix: the same tokens stand for any image), so chunked prefill
and prefix caching are refused for these models. Gemma 3's images see themselves both ways:
the prefill gives each row its own image blocks (``image_text.image_blocks`` of its image
tokens, right padding outside them; ``ImageTextModel.decode``), the decode steps are causal.
A request's images are checked when it is submitted: a text model given images, more than
``K`` images, pixels not of the tower's size, or image tokens that are not the images'
features are refused naming the fix.

The families whose images arrive at their own sizes (Qwen-VL's patches, Gemma 4's placed
patches, Idefics3's tiles) have slots of their own, padded to one bucket:
``redco_zoo_models.engine_image_buckets``.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from redco_zoo_models.engine_image_buckets import PatchSlots, PlacedPatchSlots, TileSlots


@dataclasses.dataclass(frozen=True)
class ImageSlots:
    """What an image model's prompts carry: ``shape`` (K, 3, H, W) of pixels a prompt, and
    its ``token`` repeated ``per_image`` times an image."""
    shape: tuple[int, ...]
    token: int
    per_image: int


def image_slots(model, max_images: int, prefill_chunk: int | None, prefix_caching: bool,
                max_image_patches: int = 1024) -> ImageSlots | PatchSlots | PlacedPatchSlots | \
        TileSlots | None:
    """The image slots of ``model``'s prompts; None for a text model. Raises what the engine
    cannot do with an image model (module docstring)."""
    if not hasattr(model, "encode_rows"):
        return None
    if prefill_chunk or prefix_caching:
        raise ValueError(f"{type(model).__name__} reads images: a prompt is read whole (its "
                         "image tokens name no image of their own), so drop --prefill_chunk "
                         "and --prefix_caching.")
    if max_images < 1:
        raise ValueError(f"max_images={max_images}: give at least 1 image a prompt.")
    if getattr(model, "dynamic_resolution", False):
        merge = model.cfg.vision.spatial_merge_size ** 2
        return PatchSlots(model.cfg, max_images, -(-max_image_patches // merge) * merge)
    if getattr(model, "placed_patches", False):
        pool = model.cfg.vision.pooling_kernel_size ** 2
        return PlacedPatchSlots(model.cfg, max_images, -(-max_image_patches // pool) * pool)
    vision = model.cfg.vision
    if getattr(model, "tiled_images", False):
        return TileSlots((max_images, vision.num_channels, vision.image_size, vision.image_size),
                         model.cfg.image_token_index, model.cfg.features_per_image())
    return ImageSlots((max_images, vision.num_channels, vision.image_size, vision.image_size),
                      model.cfg.image_token_index, model.cfg.features_per_image())


def check_images(slots: ImageSlots | None, prompt: list[int], images) -> None:
    """Refuse ``images`` (n, 3, H, W) that ``prompt`` cannot take (module docstring)."""
    if isinstance(slots, (PatchSlots, PlacedPatchSlots, TileSlots)):
        return slots.check(prompt, images)
    n = 0 if images is None else len(images)
    if slots is None:
        if n:
            raise ValueError("This model reads text only: send the prompt without images, or "
                             "serve an image + text model (LLaVA).")
        return
    if n > slots.shape[0]:
        raise ValueError(f"The prompt has {n} images; this engine takes at most "
                         f"{slots.shape[0]} a prompt: send fewer, or start it with a larger "
                         "max_images.")
    if n and tuple(np.shape(images)[1:]) != slots.shape[1:]:
        raise ValueError(f"The images' pixels are {tuple(np.shape(images)[1:])}, not the "
                         f"tower's {slots.shape[1:]}: make them with the model's processor.")
    found = sum(t == slots.token for t in prompt)
    if found != n * slots.per_image:
        raise ValueError(f"The prompt holds {found} image tokens (id {slots.token}) for {n} "
                         f"images x {slots.per_image}: build it with the model's processor "
                         "(one placeholder an image).")


def image_context(slots, requests: list, ids: np.ndarray):
    """The prefill's context of ``requests`` read as ``ids`` (count, width): ``PatchSlots``'
    or ``PlacedPatchSlots``' arrays, ``TileSlots``' tiles, or LLaVA's pixels (``pixel_slots``);
    None for a text model."""
    if isinstance(slots, (PatchSlots, PlacedPatchSlots, TileSlots)):
        return slots.context(requests, ids)
    return pixel_slots(requests, len(ids), slots)


def pixel_slots(requests: list, count: int, slots: ImageSlots | None):
    """(count, K, 3, H, W) float32: each prompt's images in its first slots, blank after; None
    for a text model."""
    if slots is None:
        return None
    out = np.zeros((count, *slots.shape), np.float32)
    for i, request in enumerate(requests):
        if request.images is not None:
            out[i, :len(request.images)] = request.images
    return out
