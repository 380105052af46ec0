"""Gemma 4 with images: its ``config.json`` read and written (the tower's ``vision_config``,
the decoder's ``text_config`` and the image, audio and video token ids), for
``redco_zoo_models.gemma4_vision``. A key neither read nor metadata is refused, as is an audio
tower or a text model bidirectional beyond images."""
from __future__ import annotations

import dataclasses

from redco_zoo_models.decoder_config import DecoderConfig

VISION_READS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 16,
                "num_attention_heads": 12, "num_key_value_heads": 12, "head_dim": 64,
                "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
                "pooling_kernel_size": 3, "patch_size": 16, "position_embedding_size": 10_240,
                "use_clipped_linears": False, "standardize": False, "initializer_range": 0.02}
VISION_METADATA = {"model_type", "dtype", "torch_dtype", "architectures", "transformers_version",
                   "rope_parameters", "attention_bias", "attention_dropout",
                   "max_position_embeddings"}  # (no biases in the tower's linears; unused)
READS = {"image_token_id": 258_880, "boi_token_id": 255_999, "eoi_token_id": 258_882,
         "video_token_id": 258_884, "boa_token_id": 256_000, "eoa_token_index": 258_883,
         "audio_token_id": 258_881}
METADATA = {"model_type", "architectures", "dtype", "torch_dtype", "transformers_version",
            "text_config", "vision_config", "audio_config", "tie_word_embeddings",
            "initializer_range", "pad_token_id", "bos_token_id", "eos_token_id", "use_cache"}


@dataclasses.dataclass(frozen=True)
class Gemma4VisionTowerConfig:
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 16
    num_attention_heads: int = 12
    num_key_value_heads: int = 12
    head_dim: int = 64
    hidden_activation: str = "gelu_pytorch_tanh"
    rms_norm_eps: float = 1e-6
    pooling_kernel_size: int = 3
    patch_size: int = 16
    position_embedding_size: int = 10_240
    use_clipped_linears: bool = False
    standardize: bool = False
    initializer_range: float = 0.02
    rope_theta: float = 100.0

    @classmethod
    def from_hf(cls, config: dict) -> "Gemma4VisionTowerConfig":
        if unknown := sorted(set(config) - set(VISION_READS) - VISION_METADATA):
            raise ValueError(f"vision_config has keys the zoo's Gemma 4 tower does not read: "
                             f"{unknown}.")
        rope = config.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError("vision_config.rope_parameters: Gemma 4's tower turns by axial "
                             f"RoPE, not {rope['rope_type']!r}.")
        return cls(**{k: config.get(k, d) for k, d in VISION_READS.items()},
                   rope_theta=float(rope.get("rope_theta", 100.0)))

    def to_hf(self) -> dict:
        return {**{k: getattr(self, k) for k in VISION_READS}, "model_type": "gemma4_vision",
                "rope_parameters": {"rope_type": "axial", "rope_theta": self.rope_theta}}


@dataclasses.dataclass(frozen=True)
class Gemma4VisionConfig:
    vision: Gemma4VisionTowerConfig = Gemma4VisionTowerConfig()
    text: DecoderConfig = DecoderConfig()
    bidirectional: bool = False  # use_bidirectional_attention "vision": images both ways
    image_token_id: int = 258_880
    boi_token_id: int = 255_999
    eoi_token_id: int = 258_882
    video_token_id: int = 258_884
    boa_token_id: int = 256_000
    eoa_token_index: int = 258_883
    audio_token_id: int = 258_881

    @property
    def image_token_index(self) -> int:  # (ImageTextModel's name)
        return self.image_token_id

    @classmethod
    def from_hf(cls, config: dict) -> "Gemma4VisionConfig":
        """From a ``gemma4`` config.json with a ``vision_config``; a top-level key it does not
        read is refused, and an audio tower."""
        if unknown := sorted(set(config) - set(READS) - METADATA):
            raise ValueError(f"config.json has keys the zoo's Gemma 4 does not read: {unknown}.")
        if config.get("audio_config"):
            raise ValueError("config.json has an audio_config: the zoo's Gemma 4 reads images "
                             "and text, not audio yet; save the model without its audio tower.")
        text = {"model_type": "gemma4_text", "tie_word_embeddings": config.get(
            "tie_word_embeddings", True), **config.get("text_config", {})}
        both_ways = text.get("use_bidirectional_attention")
        if both_ways not in (None, False, "vision"):
            raise ValueError(f"text_config.use_bidirectional_attention {both_ways!r}: the zoo's "
                             "Gemma 4 reads a causal decoder (None) or \"vision\".")
        return cls(Gemma4VisionTowerConfig.from_hf(config.get("vision_config", {})),
                   DecoderConfig.from_hf(text), both_ways == "vision",
                   **{k: config.get(k, d) for k, d in READS.items()})

    def to_hf(self) -> dict:
        text = {k: v for k, v in self.text.to_hf().items() if k != "architectures"}
        if self.bidirectional:
            text["use_bidirectional_attention"] = "vision"
        return {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"],
                "vision_config": self.vision.to_hf(), "audio_config": None,
                "text_config": text, "tie_word_embeddings": text.get("tie_word_embeddings", True),
                **{k: getattr(self, k) for k in READS}}
