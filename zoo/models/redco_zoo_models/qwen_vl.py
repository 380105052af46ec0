"""Qwen2.5-VL, Qwen3-VL and Qwen3.5 (transformers' ``Qwen2_5_VLForConditionalGeneration``,
``Qwen3VLForConditionalGeneration``, ``Qwen3_5ForConditionalGeneration`` and its MoE) in Flax
NNX: images of any size + text in, text out.

The processor gives ``pixel_values`` (patches, features) and ``image_grid_thw`` (images, 3)
and repeats ``<|image_pad|>`` once per merged block of each image. The vision tower
(``redco_zoo_models.qwen_vision``, ``qwen3_vision``) turns the patches into one feature per
image token, in the language model's width; they replace those tokens' embeddings in order
(``image_text.ImageTextModel.embed``). The language model is the zoo's decoder (Qwen2, Qwen3
or Qwen3.5's Gated DeltaNet hybrid, ``redco_zoo_models.qwen_vl_config``) with M-RoPE: its
positions (3, B, T) are made on the host from the ids and the grids
(``redco_zoo_models.mrope``), and generation places new tokens by each row's delta (kept in
the cache, ``init_cache``, for the serving engine's decode steps; its prefill's rows:
``engine_image_buckets.PatchSlots``, each prompt's patches padded to one bucket, ``padded_patches``).
Qwen3-VL's DeepStack features (one set per ``deepstack_visual_indexes`` block of the tower)
are added to the decoder's hidden states at the image tokens after its first layers, in a
prompt or a training row (not in the decode steps, which hold no image). A prompt whose image
tokens do not match the grids is refused before compiling. Videos
(``pixel_values_videos``) are not built: the model takes no video input.

Checkpoint names: transformers' saved layouts, Qwen2.5-VL's (``model.layers.*`` the language
model, ``visual.*`` the tower, ``lm_head``) and Qwen3-VL's (``model.language_model.*``,
``model.visual.*``, as Qwen3.5's, whose multi-token-prediction head ``mtp.*`` is dropped as
transformers drops it), either read for both, each family written in its own. The tower's 5-D
patch kernel is reshaped to a matrix on import and back on export; Qwen2.5-VL's merger's
``mlp.0``/``mlp.2`` are ``fc1``/``fc2`` here.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from redco_zoo_models.decoder import DecoderLM
from redco_zoo_models.image_text import ImageTextModel
from redco_zoo_models.mrope import decode_positions, rope_index
from redco_zoo_models.qwen_vl_config import (
    Qwen3_5MoeVLConfig,
    Qwen3_5VLConfig,
    Qwen3VLConfig,
    QwenVLConfig,
)

NAMES_IN = [(r"^model\.visual\.", "visual."), (r"^model\.language_model\.", "language_model.model."),
            (r"^model\.", "language_model.model."), (r"^lm_head\.", "language_model.lm_head."),
            (r"^visual\.merger\.mlp\.0\.", "visual.merger.fc1."),
            (r"^visual\.merger\.mlp\.2\.", "visual.merger.fc2.")]
NAMES_OUT = [(r"^language_model\.model\.", "model."), (r"^language_model\.lm_head\.", "lm_head."),
             (r"^visual\.merger\.fc1\.", "visual.merger.mlp.0."),
             (r"^visual\.merger\.fc2\.", "visual.merger.mlp.2.")]
PATCH_KERNEL = "visual.patch_embed.proj.weight"


class QwenVLForConditionalGeneration(ImageTextModel):
    """``__call__(input_ids, attention_mask, pixel_values, image_grid_thw)``: logits."""
    config_class = QwenVLConfig
    names_out = NAMES_OUT
    dynamic_resolution = True  # (the serving engine's prompts: engine_image_buckets.PatchSlots)

    def __init__(self, cfg: QwenVLConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.visual = cfg.TOWER(cfg.vision, rngs)
        self.language_model = DecoderLM(cfg.text, rngs)
        self.stack_tower(self.visual)

    def image_features(self, pixel_values, image_grid_thw, layout: dict | None = None):
        """``(features, deepstack)``: every image's features in order (image tokens, hidden),
        and Qwen3-VL's DeepStack ones (a list; empty for Qwen2.5-VL). ``layout``: the config's
        ``LAYOUT(image_grid_thw, cfg.vision)`` (made here from a concrete grid)."""
        if layout is None:
            if isinstance(image_grid_thw, jax.core.Tracer):
                raise ValueError("image_grid_thw is traced: inside jit pass layout=cfg.LAYOUT("
                                 "image_grid_thw, cfg.vision), made on the host.")
            layout = self.cfg.LAYOUT(image_grid_thw, self.cfg.vision)
        return self.visual(pixel_values, layout)

    def positions(self, input_ids, attention_mask, image_grid_thw):
        """M-RoPE's ``(positions (3, B, T), deltas (B,))``, made on the host (``mrope``)."""
        if isinstance(input_ids, jax.core.Tracer):
            raise ValueError("input_ids are traced: inside jit pass position_ids made on the host "
                             "by redco_zoo_models.mrope.rope_index.")
        return rope_index(input_ids, attention_mask, image_grid_thw, self.cfg.image_token_id,
                          self.cfg.vision.spatial_merge_size)

    def encode(self, pixel_values, image_grid_thw, input_ids, attention_mask=None) -> dict:
        """What generation needs of a prompt with images: its image features (and DeepStack's),
        its M-RoPE positions and each row's delta (``generate(encoder_inputs=...)`` with
        these four)."""
        positions, deltas = self.positions(input_ids, attention_mask, image_grid_thw)
        self.check_tokens(input_ids, image_grid_thw)
        features, deep = self.image_features(pixel_values, image_grid_thw)
        return {"features": features, "deepstack": deep, "positions": positions,
                "deltas": deltas}

    def __call__(self, input_ids, attention_mask=None, pixel_values=None, image_grid_thw=None,
                 position_ids=None, layout=None, labels=None, label_mask=None, image_mask=None):
        """Logits (or with ``labels`` the mean loss, as ``DecoderLM``); text alone without
        ``pixel_values``. ``position_ids`` (3, B, T) and ``layout``: made on the host here
        from concrete ids and grids, given inside jit; ``pixel_values`` (B, P, features) of
        each row's patches (``row_features``) with both given, placed at the tokens
        ``image_mask`` marks (default: every image token; GRPO's: the prompt's, ``embed``)."""
        if pixel_values is None:
            return self.language_model(input_ids, attention_mask, labels=labels,
                                       label_mask=label_mask)
        if pixel_values.ndim == 3:  # (B, P, features): each row's patches (row_features)
            if position_ids is None or layout is None:
                raise ValueError("pixel_values of rows (B, P, features) need position_ids and "
                                 "layout made on the host for each row.")
            features, deep = self.row_features(pixel_values, layout)
            return self.language_model(
                input_ids, attention_mask, labels=labels, label_mask=label_mask,
                positions=position_ids,
                inputs_embeds=self.embed(input_ids, features, True, image_mask),
                deepstack=self.deepstack(input_ids, deep, True, image_mask))
        if position_ids is None:
            position_ids = self.positions(input_ids, attention_mask, image_grid_thw)[0]
        self.check_tokens(input_ids, image_grid_thw)
        features, deep = self.image_features(pixel_values, image_grid_thw, layout)
        return self.language_model(input_ids, attention_mask, labels=labels,
                                   label_mask=label_mask, positions=position_ids,
                                   inputs_embeds=self.embed(input_ids, features),
                                   deepstack=self.deepstack(input_ids, deep))

    def row_features(self, pixel_values, layout: dict):
        """``image_features`` of each row (the SFT pipeline's batches): ``pixel_values`` (B, P,
        features), a row's images' patches then padding; ``layout`` (B, P, ...): each row's
        ``LAYOUT`` of its grids, a padded patch in frame and window -1 (attending to no real
        patch) and reading no position. Features (B, P / merge ** 2, hidden), each row's real
        ones first (placed at its image tokens in order; the padded ones never placed)."""
        return jax.vmap(self.visual)(pixel_values, layout)

    def deepstack(self, input_ids, deep: list, per_row: bool = False, image_mask=None):
        """DeepStack's features placed at the image tokens (``image_mask``'s, as ``embed``),
        zeros elsewhere (``None``: none)."""
        if not deep:
            return None
        zeros = jnp.zeros((*input_ids.shape, self.cfg.text.hidden_size), deep[0].dtype)
        return [self.place(input_ids, d, zeros, per_row, image_mask) for d in deep]

    def check_tokens(self, input_ids, image_grid_thw) -> None:
        """Refuse a prompt whose image tokens are not the images' merged patches, or with video
        tokens (skipped for traced ids or grids)."""
        if any(isinstance(a, jax.core.Tracer) for a in (input_ids, image_grid_thw)):
            return
        if np.any(np.asarray(input_ids) == self.cfg.video_token_id):
            raise ValueError(f"input_ids hold video tokens (id {self.cfg.video_token_id}): the "
                             "zoo's Qwen-VL models read images, not videos yet; pass each frame "
                             "as an image.")
        merge = self.cfg.vision.spatial_merge_size
        n_features = int(np.prod(np.asarray(image_grid_thw), -1).sum()) // merge ** 2
        n = int(np.sum(np.asarray(input_ids) == self.cfg.image_token_id))
        if n != n_features:
            raise ValueError(f"input_ids hold {n} image tokens (id {self.cfg.image_token_id}) "
                             f"but image_grid_thw gives {n_features} merged patches: build the "
                             "prompt with the model's processor.")

    def decode(self, ids, key_valid, cache, cache_index, context=None):
        """One generation step (``redco_zoo_models.generation``); ``context``: ``encode``'s, or
        the serving engine's prefill's (``engine_image_buckets.PatchSlots``: each prompt's padded
        patches, layout, positions and delta). The cache keeps each row's delta (``init_cache``)
        for the decode steps, which the engine runs without a context."""
        layers, delta = cache["layers"], cache["delta"]
        deep = None
        if context is not None and "pixels" in context:  # (the engine's prefill, a row each)
            features, deep = self.row_features(context["pixels"], context["layout"])
            embeds, positions = self.embed(ids, features, True), context["positions"]
            deep, delta = self.deepstack(ids, deep, per_row=True), context["deltas"]
        elif context is not None and isinstance(cache_index, int) and cache_index == 0:
            embeds, positions = self.embed(ids, context["features"]), context["positions"]
            deep, delta = self.deepstack(ids, context["deepstack"]), context["deltas"]
        else:
            delta = delta if context is None else context["deltas"]
            embeds = self.language_model.model.embed(ids)
            positions = decode_positions(key_valid, cache_index, ids.shape[1], delta)
        logits, layers = self.language_model(ids, key_valid, layers, cache_index,
                                             inputs_embeds=embeds, positions=positions,
                                             deepstack=deep)
        return logits, {"layers": layers, "delta": jnp.asarray(delta, jnp.int32)}

    def init_cache(self, batch: int, n_slots: int, dtype=jnp.float32) -> dict:
        """The language model's cache and each row's M-RoPE delta (no slot axis: the engine
        copies it with its row)."""
        return {"layers": self.language_model.init_cache(batch, n_slots, dtype),
                "delta": jnp.zeros(batch, jnp.int32)}

    def hf_tensors_in(self, tensors: dict) -> dict:
        for pattern, name in NAMES_IN:
            tensors = {re.sub(pattern, name, k): v for k, v in tensors.items()}
        if PATCH_KERNEL in tensors:
            kernel = tensors[PATCH_KERNEL]
            tensors[PATCH_KERNEL] = np.asarray(kernel).reshape(len(kernel), -1)
        return self._language_part(tensors, self.language_model.hf_tensors_in)

    def hf_tensors_out(self, tensors: dict) -> dict:
        tensors = self._language_part(tensors, self.language_model.hf_tensors_out)
        v = self.cfg.vision
        tensors[PATCH_KERNEL] = tensors[PATCH_KERNEL].reshape(
            -1, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
        for pattern, name in self.names_out:
            tensors = {re.sub(pattern, name, k): v for k, v in tensors.items()}
        return tensors


class Qwen3VLForConditionalGeneration(QwenVLForConditionalGeneration):
    """Qwen3-VL: its tower, a Qwen3 decoder, interleaved M-RoPE and DeepStack."""
    config_class = Qwen3VLConfig
    names_out = [(r"^language_model\.model\.", "model.language_model."),
                 (r"^language_model\.lm_head\.", "lm_head."), (r"^visual\.", "model.visual.")]


class Qwen3_5VLForConditionalGeneration(Qwen3VLForConditionalGeneration):
    """Qwen3.5 (``Qwen3_5ForConditionalGeneration``): Qwen3-VL's tower without DeepStack over
    the Gated DeltaNet hybrid decoder, interleaved M-RoPE in its attention layers."""
    config_class = Qwen3_5VLConfig

    def hf_tensors_in(self, tensors: dict) -> dict:
        return super().hf_tensors_in({k: v for k, v in tensors.items()
                                      if not k.startswith("mtp.")})


class Qwen3_5MoeVLForConditionalGeneration(Qwen3_5VLForConditionalGeneration):
    """Qwen3.5's MoE (``Qwen3_5MoeForConditionalGeneration``)."""
    config_class = Qwen3_5MoeVLConfig


PADDED = {"frame": -1, "window": -1}  # (layout keys a padded patch differs in; others 0)


def padded_patches(pixel_values, grids, cfg: QwenVLConfig, patches: int) -> tuple:
    """``(pixel_values (patches, features), layout {key: (patches, ...)})``: one row's images'
    patches (the processor's, their ``grids`` (images, 3); none: ``grids`` empty) then zeros,
    and their ``cfg.LAYOUT``, a padded patch in frame and window -1 (attending to no real patch,
    reading no position): ``row_features``' rows, so that one shape serves any images."""
    pixels = np.zeros((patches, cfg.vision.patch_features()), np.float32)
    if len(grids) == 0:
        layout = cfg.LAYOUT(np.ones((1, 3), np.int64) * [1, 2, 2], cfg.vision)  # (its keys)
        return pixels, {k: np.full((patches, *v.shape[1:]), PADDED.get(k, 0), v.dtype)
                        for k, v in layout.items()}
    pixels[:len(pixel_values)] = pixel_values
    layout = {}
    for key, value in cfg.LAYOUT(np.asarray(grids), cfg.vision).items():
        layout[key] = np.full((patches, *value.shape[1:]), PADDED.get(key, 0), value.dtype)
        layout[key][:len(value)] = value
    return pixels, layout
