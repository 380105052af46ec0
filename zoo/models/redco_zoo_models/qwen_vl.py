"""Qwen2.5-VL (transformers' ``Qwen2_5_VLForConditionalGeneration``) in Flax NNX: images of
any size + text in, text out.

The processor gives ``pixel_values`` (patches, features) and ``image_grid_thw`` (images, 3)
and repeats ``<|image_pad|>`` once per merged block of each image. The vision tower
(``redco_zoo_models.qwen_vision``) turns the patches into one feature per image token, in the
language model's width; they replace those tokens' embeddings in order
(``image_text.ImageTextModel.embed``). The language model is the zoo's Qwen2 decoder
(``qwen2_5_vl_text``: q/k/v biases) with M-RoPE: its positions (3, B, T) are made on the host
from the ids and the grids (``redco_zoo_models.mrope``), and generation places new tokens by
each row's delta. A prompt whose image tokens do not match the grids is refused before
compiling. Videos (``pixel_values_videos``) are not built: the model takes no video input.

Checkpoint names: transformers' saved layout (``model.layers.*`` the language model,
``visual.*`` the tower, ``lm_head``); its in-memory one (``model.language_model.*``,
``model.visual.*``) is read too. The tower's 5-D patch kernel is reshaped to a matrix on
import and back on export; the merger's ``mlp.0``/``mlp.2`` are ``fc1``/``fc2`` here.
"""
from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
from flax import nnx

from redco_zoo_models.decoder import DecoderLM
from redco_zoo_models.decoder_config import DecoderConfig
from redco_zoo_models.image_text import ImageTextModel
from redco_zoo_models.mrope import decode_positions, rope_index
from redco_zoo_models.qwen_vision import QwenVisionConfig, QwenVisionModel, patch_layout

READS = {"image_token_id": 151_655, "video_token_id": 151_656,
         "vision_start_token_id": 151_652, "vision_end_token_id": 151_653}
METADATA = {"model_type", "architectures", "dtype", "torch_dtype", "transformers_version",
            "text_config", "vision_config", "tie_word_embeddings", "use_cache", "pad_token_id",
            "bos_token_id", "eos_token_id", "initializer_range"}
NAMES_IN = [(r"^model\.visual\.", "visual."), (r"^model\.language_model\.", "language_model.model."),
            (r"^model\.", "language_model.model."), (r"^lm_head\.", "language_model.lm_head."),
            (r"^visual\.merger\.mlp\.0\.", "visual.merger.fc1."),
            (r"^visual\.merger\.mlp\.2\.", "visual.merger.fc2.")]
NAMES_OUT = [(r"^language_model\.model\.", "model."), (r"^language_model\.lm_head\.", "lm_head."),
             (r"^visual\.merger\.fc1\.", "visual.merger.mlp.0."),
             (r"^visual\.merger\.fc2\.", "visual.merger.mlp.2.")]
PATCH_KERNEL = "visual.patch_embed.proj.weight"


@dataclasses.dataclass(frozen=True)
class QwenVLConfig:
    vision: QwenVisionConfig = QwenVisionConfig()
    text: DecoderConfig = DecoderConfig()
    image_token_id: int = 151_655
    video_token_id: int = 151_656
    vision_start_token_id: int = 151_652
    vision_end_token_id: int = 151_653

    @property
    def image_token_index(self) -> int:  # (ImageTextModel's name)
        return self.image_token_id

    @classmethod
    def from_hf(cls, config: dict) -> "QwenVLConfig":
        """From a ``qwen2_5_vl`` config.json; a top-level key it does not read is refused, and
        a text config without ``mrope_section``."""
        if unknown := sorted(set(config) - set(READS) - METADATA):
            raise ValueError(f"config.json has keys the zoo's Qwen2.5-VL does not read: {unknown}.")
        text = {**config.get("text_config", {}), "model_type": "qwen2"}
        rope = dict(text.get("rope_parameters") or {})
        section = rope.pop("mrope_section", None)
        if section is None or rope.pop("mrope_interleaved", False):
            raise ValueError("text_config.rope_parameters: Qwen2.5-VL reads M-RoPE with an "
                             "mrope_section (3 runs of pairs), not interleaved (Qwen3-VL's, not "
                             "built yet).")
        text_cfg = DecoderConfig.from_hf({**text, "rope_parameters": rope})
        text_cfg = dataclasses.replace(text_cfg, rope=dataclasses.replace(
            text_cfg.rope, mrope_section=tuple(section)))
        if sum(section) != text_cfg.rope.rotary_dim // 2:
            raise ValueError(f"text_config: mrope_section {section} must sum to the "
                             f"{text_cfg.rope.rotary_dim // 2} rotary pairs of a head.")
        return cls(QwenVisionConfig.from_hf(config.get("vision_config", {})), text_cfg,
                   **{k: config.get(k, d) for k, d in READS.items()})

    def to_hf(self) -> dict:
        text = {k: v for k, v in self.text.to_hf().items() if k != "architectures"}
        return {"model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"],
                "vision_config": self.vision.to_hf(),
                "text_config": {**text, "model_type": "qwen2_5_vl_text"},
                "tie_word_embeddings": text.get("tie_word_embeddings", False),
                **{k: getattr(self, k) for k in READS}}


class QwenVLForConditionalGeneration(ImageTextModel):
    """``__call__(input_ids, attention_mask, pixel_values, image_grid_thw)``: logits."""
    config_class = QwenVLConfig

    def __init__(self, cfg: QwenVLConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.visual = QwenVisionModel(cfg.vision, rngs)
        self.language_model = DecoderLM(cfg.text, rngs)

    def image_features(self, pixel_values, image_grid_thw, layout: dict | None = None):
        """(image tokens, hidden): every image's features, in order; ``layout``:
        ``qwen_vision.patch_layout``'s (made here from a concrete ``image_grid_thw``)."""
        if layout is None:
            if isinstance(image_grid_thw, jax.core.Tracer):
                raise ValueError("image_grid_thw is traced: inside jit pass layout="
                                 "patch_layout(image_grid_thw, cfg.vision), made on the host.")
            layout = patch_layout(image_grid_thw, self.cfg.vision)
        return self.visual(pixel_values, layout)

    def positions(self, input_ids, attention_mask, image_grid_thw):
        """M-RoPE's ``(positions (3, B, T), deltas (B,))``, made on the host (``mrope``)."""
        if isinstance(input_ids, jax.core.Tracer):
            raise ValueError("input_ids are traced: inside jit pass position_ids made on the host "
                             "by redco_zoo_models.mrope.rope_index.")
        return rope_index(input_ids, attention_mask, image_grid_thw, self.cfg.image_token_id,
                          self.cfg.vision.spatial_merge_size)

    def encode(self, pixel_values, image_grid_thw, input_ids, attention_mask=None) -> dict:
        """What generation needs of a prompt with images: its image features, its M-RoPE
        positions and each row's delta (``generate(encoder_inputs=...)`` with these four)."""
        positions, deltas = self.positions(input_ids, attention_mask, image_grid_thw)
        self.check_tokens(input_ids, image_grid_thw)
        return {"features": self.image_features(pixel_values, image_grid_thw),
                "positions": positions, "deltas": deltas}

    def __call__(self, input_ids, attention_mask=None, pixel_values=None, image_grid_thw=None,
                 position_ids=None, layout=None, labels=None, label_mask=None):
        """Logits (or with ``labels`` the mean loss, as ``DecoderLM``); text alone without
        ``pixel_values``. ``position_ids`` (3, B, T) and ``layout``: made on the host here
        from concrete ids and grids, given inside jit."""
        features = None
        if pixel_values is not None:
            if position_ids is None:
                position_ids = self.positions(input_ids, attention_mask, image_grid_thw)[0]
            self.check_tokens(input_ids, image_grid_thw)
            features = self.image_features(pixel_values, image_grid_thw, layout)
        return self.language_model(input_ids, attention_mask, labels=labels,
                                   label_mask=label_mask, positions=position_ids,
                                   inputs_embeds=self.embed(input_ids, features))

    def check_tokens(self, input_ids, image_grid_thw) -> None:
        """Refuse a prompt whose image tokens are not the images' merged patches (skipped for
        traced ids or grids)."""
        if any(isinstance(a, jax.core.Tracer) for a in (input_ids, image_grid_thw)):
            return
        merge = self.cfg.vision.spatial_merge_size
        n_features = int(np.prod(np.asarray(image_grid_thw), -1).sum()) // merge ** 2
        n = int(np.sum(np.asarray(input_ids) == self.cfg.image_token_id))
        if n != n_features:
            raise ValueError(f"input_ids hold {n} image tokens (id {self.cfg.image_token_id}) "
                             f"but image_grid_thw gives {n_features} merged patches: build the "
                             "prompt with the model's processor.")

    def decode(self, ids, key_valid, cache, cache_index, context=None):
        """One generation step (``redco_zoo_models.generation``); ``context``: ``encode``'s."""
        if context is None:
            return self.language_model(ids, key_valid, cache, cache_index)
        prefill = isinstance(cache_index, int) and cache_index == 0
        if prefill:
            embeds, positions = self.embed(ids, context["features"]), context["positions"]
        else:
            embeds = self.language_model.model.embed(ids)
            positions = decode_positions(key_valid, cache_index, ids.shape[1], context["deltas"])
        return self.language_model(ids, key_valid, cache, cache_index, inputs_embeds=embeds,
                                   positions=positions)

    def unserved(self) -> str | None:
        return ("QwenVLForConditionalGeneration: its M-RoPE positions come from each prompt's "
                "image grids, which the serving engine's prefill does not build yet; generate() "
                "with encoder_inputs=model.encode's arguments instead.")

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
        for pattern, name in NAMES_OUT:
            tensors = {re.sub(pattern, name, k): v for k, v in tensors.items()}
        return tensors
