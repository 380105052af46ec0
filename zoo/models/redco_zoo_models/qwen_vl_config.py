"""What a Qwen2.5-VL or Qwen3-VL ``config.json`` says, for ``redco_zoo_models.qwen_vl``.

Both hold a ``vision_config`` (the tower: ``qwen_vision`` for Qwen2.5-VL, ``qwen3_vision`` for
Qwen3-VL), a ``text_config`` read as the zoo's decoder of the family the language model is
(Qwen2: q/k/v biases; Qwen3: per-head q/k norms) and the image and video token ids. The text
config's ``rope_parameters`` carry M-RoPE's ``mrope_section``: Qwen2.5-VL's runs of pairs,
Qwen3-VL's interleaved (transformers interleaves Qwen3-VL's whatever ``mrope_interleaved``
says, and never Qwen2.5-VL's: a Qwen2.5-VL config asking for it is refused).

Qwen3.5 (``qwen3_5``, ``qwen3_5_moe``) is Qwen3-VL's data with its own: the tower without
DeepStack (``qwen3_vision.Qwen3_5VisionConfig``), the Gated DeltaNet hybrid decoder
(``qwen3_5_text``, ``qwen3_5_moe_text``) whose full-attention layers turn a
``partial_rotary_factor`` of each head by interleaved M-RoPE (``mrope_section`` defaulting to
transformers' ``[11, 11, 10]``), and its own token ids.
"""
from __future__ import annotations

import dataclasses

from redco_zoo_models.decoder_config import DecoderConfig
from redco_zoo_models.qwen3_vision import (
    Qwen3_5MoeVisionConfig,
    Qwen3_5VisionConfig,
    Qwen3VisionConfig,
    Qwen3VisionModel,
    interpolation,
)
from redco_zoo_models.qwen_vision import QwenVisionConfig, QwenVisionModel, patch_layout

READS = {"image_token_id": 151_655, "video_token_id": 151_656,
         "vision_start_token_id": 151_652, "vision_end_token_id": 151_653}
METADATA = {"model_type", "architectures", "dtype", "torch_dtype", "transformers_version",
            "text_config", "vision_config", "tie_word_embeddings", "use_cache", "pad_token_id",
            "bos_token_id", "eos_token_id", "initializer_range"}


@dataclasses.dataclass(frozen=True)
class QwenVLConfig:
    """Qwen2.5-VL's (``Qwen3VLConfig``: Qwen3-VL's)."""
    vision: QwenVisionConfig = QwenVisionConfig()
    text: DecoderConfig = DecoderConfig()
    image_token_id: int = 151_655
    video_token_id: int = 151_656
    vision_start_token_id: int = 151_652
    vision_end_token_id: int = 151_653

    NAME, MODEL_TYPE, TEXT_FAMILY = "Qwen2.5-VL", "qwen2_5_vl", "qwen2"
    ARCHITECTURE, INTERLEAVED = "Qwen2_5_VLForConditionalGeneration", False
    VISION, TOWER, LAYOUT = QwenVisionConfig, QwenVisionModel, staticmethod(patch_layout)
    SECTION = None  # mrope_section when the text config has none (None: refused)

    @property
    def image_token_index(self) -> int:  # (ImageTextModel's name)
        return self.image_token_id

    @classmethod
    def from_hf(cls, config: dict) -> "QwenVLConfig":
        """From a config.json of this family; a top-level key it does not read is refused, and
        a text config without a fitting ``mrope_section``."""
        if unknown := sorted(set(config) - set(READS) - METADATA):
            raise ValueError(f"config.json has keys the zoo's {cls.NAME} does not read: "
                             f"{unknown}.")
        text = {**config.get("text_config", {}), "model_type": cls.TEXT_FAMILY}
        rope = dict(text.get("rope_parameters") or {})
        section = rope.pop("mrope_section", cls.SECTION)
        if section is None or (rope.pop("mrope_interleaved", False) and not cls.INTERLEAVED):
            raise ValueError(f"text_config.rope_parameters: {cls.NAME} reads M-RoPE with an "
                             "mrope_section" + ("" if cls.INTERLEAVED else
                                                " (3 runs of pairs), not interleaved") + ".")
        text_cfg = DecoderConfig.from_hf({**text, "rope_parameters": rope})
        text_cfg = dataclasses.replace(text_cfg, rope=dataclasses.replace(
            text_cfg.rope, mrope_section=tuple(section), mrope_interleaved=cls.INTERLEAVED))
        if sum(section) != text_cfg.rope.rotary_dim // 2:
            raise ValueError(f"text_config: mrope_section {section} must sum to the "
                             f"{text_cfg.rope.rotary_dim // 2} rotary pairs of a head.")
        return cls(cls.VISION.from_hf(config.get("vision_config", {})), text_cfg,
                   **{k: config.get(k, getattr(cls, k)) for k in READS})

    def to_hf(self) -> dict:
        text = {k: v for k, v in self.text.to_hf().items() if k != "architectures"}
        return {"model_type": self.MODEL_TYPE, "architectures": [self.ARCHITECTURE],
                "vision_config": self.vision.to_hf(),
                "text_config": {**text, "model_type": f"{self.MODEL_TYPE}_text"},
                "tie_word_embeddings": text.get("tie_word_embeddings", False),
                **{k: getattr(self, k) for k in READS}}


@dataclasses.dataclass(frozen=True)
class Qwen3VLConfig(QwenVLConfig):
    vision: Qwen3VisionConfig = Qwen3VisionConfig()

    NAME, MODEL_TYPE, TEXT_FAMILY = "Qwen3-VL", "qwen3_vl", "qwen3"
    ARCHITECTURE, INTERLEAVED = "Qwen3VLForConditionalGeneration", True
    VISION, TOWER, LAYOUT = Qwen3VisionConfig, Qwen3VisionModel, staticmethod(interpolation)


@dataclasses.dataclass(frozen=True)
class Qwen3_5VLConfig(Qwen3VLConfig):
    """Qwen3.5's multimodal checkpoint (``Qwen3_5ForConditionalGeneration``)."""
    vision: Qwen3_5VisionConfig = Qwen3_5VisionConfig()
    image_token_id: int = 248_056
    video_token_id: int = 248_057
    vision_start_token_id: int = 248_053
    vision_end_token_id: int = 248_054

    NAME, MODEL_TYPE, TEXT_FAMILY = "Qwen3.5", "qwen3_5", "qwen3_5_text"
    ARCHITECTURE, VISION, SECTION = "Qwen3_5ForConditionalGeneration", Qwen3_5VisionConfig, \
        (11, 11, 10)


@dataclasses.dataclass(frozen=True)
class Qwen3_5MoeVLConfig(Qwen3_5VLConfig):
    """Qwen3.5's MoE multimodal checkpoint (``Qwen3_5MoeForConditionalGeneration``)."""
    vision: Qwen3_5MoeVisionConfig = Qwen3_5MoeVisionConfig()

    NAME, MODEL_TYPE, TEXT_FAMILY = "Qwen3.5-MoE", "qwen3_5_moe", "qwen3_5_moe_text"
    ARCHITECTURE, VISION = "Qwen3_5MoeForConditionalGeneration", Qwen3_5MoeVisionConfig
