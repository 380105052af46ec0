"""Gemma 3 with images (transformers' ``Gemma3ForConditionalGeneration``) in Flax NNX.

Each image runs through SigLIP's tower (``redco_zoo_models.siglip_vision``); its patch grid
(``image_size / patch_size`` a side) is average-pooled to ``mm_tokens_per_image`` tokens
(a square, ``sqrt(mm_tokens_per_image)`` a side, in row-major order), normed by Gemma's RMSNorm
(``mm_soft_emb_norm``, ``x / rms(x) * (1 + w)``, the tower's ``layer_norm_eps``) and projected
by ``mm_input_projection_weight`` (vision hidden, text hidden) into the Gemma 3 text decoder
(``gemma3_text``: its embeddings scaled by ``sqrt(hidden)``, the image features placed after
that, unscaled). Each run of image tokens sees itself both ways in every layer (a sliding
layer's window on top), as transformers does given ``token_type_ids``; the rest is
``redco_zoo_models.image_text``.
"""
from __future__ import annotations

import dataclasses

from flax import nnx

from redco_zoo_models.decoder import DecoderLM
from redco_zoo_models.decoder_config import DecoderConfig
from redco_zoo_models.image_text import ImageTextModel
from redco_zoo_models.layers import RMSNorm
from redco_zoo_models.siglip_vision import SiglipVisionConfig, SiglipVisionModel

READS = {"mm_tokens_per_image": 256, "boi_token_index": 255_999, "eoi_token_index": 256_000,
         "image_token_index": 262_144}
METADATA = {"model_type", "architectures", "dtype", "torch_dtype", "transformers_version",
            "text_config", "vision_config", "tie_word_embeddings", "initializer_range",
            "pad_token_id", "bos_token_id", "eos_token_id", "use_cache"}


@dataclasses.dataclass(frozen=True)
class Gemma3VisionConfig:
    vision: SiglipVisionConfig = SiglipVisionConfig()
    text: DecoderConfig = DecoderConfig()
    mm_tokens_per_image: int = 256
    boi_token_index: int = 255_999
    eoi_token_index: int = 256_000
    image_token_index: int = 262_144

    def __post_init__(self):
        side, patches = round(self.mm_tokens_per_image ** 0.5), self.patches_per_side()
        if side * side != self.mm_tokens_per_image or patches % side:
            raise ValueError(f"mm_tokens_per_image {self.mm_tokens_per_image}: it must be a "
                             f"square whose side divides the {patches} patches a side.")

    def patches_per_side(self) -> int:
        return self.vision.image_size // self.vision.patch_size

    def features_per_image(self) -> int:
        return self.mm_tokens_per_image

    @classmethod
    def from_hf(cls, config: dict) -> "Gemma3VisionConfig":
        """From a ``gemma3`` config.json with a ``vision_config``; a top-level key it does not
        read is refused."""
        unknown = sorted(set(config) - set(READS) - METADATA)
        if unknown:
            raise ValueError(f"config.json has keys the zoo's Gemma 3 does not read: {unknown}.")
        text = {"model_type": "gemma3_text", "tie_word_embeddings": config.get(
            "tie_word_embeddings", True), **config.get("text_config", {})}
        return cls(SiglipVisionConfig.from_hf(config.get("vision_config", {})),
                   DecoderConfig.from_hf(text), **{k: config.get(k, d) for k, d in READS.items()})

    def to_hf(self) -> dict:
        text = self.text.to_hf()
        return {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
                "vision_config": self.vision.to_hf(), "text_config": text,
                "tie_word_embeddings": text.get("tie_word_embeddings", True),
                **{k: getattr(self, k) for k in READS}}


class Projector(nnx.Module):
    """Average pool to ``mm_tokens_per_image``, Gemma's RMSNorm, then a matrix."""

    def __init__(self, cfg: Gemma3VisionConfig, rngs: nnx.Rngs):
        self.mm_input_projection_weight = nnx.Param(nnx.initializers.zeros(
            rngs.params(), (cfg.vision.hidden_size, cfg.text.hidden_size)))
        self.mm_soft_emb_norm = RMSNorm(cfg.vision.hidden_size, cfg.vision.layer_norm_eps, 1.0)
        self.side, self.patches = round(cfg.mm_tokens_per_image ** 0.5), cfg.patches_per_side()

    def __call__(self, x):
        b, _, d = x.shape
        k = self.patches // self.side  # (the pooling window, a side)
        x = x.reshape(b, self.side, k, self.side, k, d).mean((2, 4)).reshape(b, -1, d)
        return self.mm_soft_emb_norm(x) @ self.mm_input_projection_weight[...].astype(x.dtype)


class Gemma3ForConditionalGeneration(ImageTextModel):
    """``__call__(input_ids, attention_mask, pixel_values)``: logits (B, T, vocab)."""
    config_class = Gemma3VisionConfig
    bidirectional_images = True

    def __init__(self, cfg: Gemma3VisionConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.vision_tower = SiglipVisionModel(cfg.vision, rngs)
        self.multi_modal_projector = Projector(cfg, rngs)
        self.language_model = DecoderLM(cfg.text, rngs)
        self.stack_tower(self.vision_tower.encoder)

    def encode(self, pixel_values):
        """The projected features of each image: (images, mm_tokens_per_image, hidden)."""
        return self.multi_modal_projector(self.vision_tower(pixel_values))

    def hf_tensors_in(self, tensors: dict) -> dict:
        """As ``ImageTextModel``'s, without SigLIP's pooling head (Gemma 3 does not use it)."""
        return super().hf_tensors_in({k: v for k, v in tensors.items()
                                      if not k.startswith(("vision_tower.head.",
                                                           "vision_tower.vision_model.head."))})
