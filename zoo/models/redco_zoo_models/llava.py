"""LLaVA (transformers' ``LlavaForConditionalGeneration``) in Flax NNX: image + text in, text out.

Each image (``pixel_values`` (images, 3, H, W), made on the host by the model's own
transformers image processor) runs through CLIP's vision tower
(``redco_zoo_models.clip_vision``); the hidden state(s) at ``vision_feature_layer`` (-2 by
default: the input of the last layer; a list: concatenated over the hidden size) are taken
without the class token (``vision_feature_select_strategy`` ``"default"``; ``"full"`` keeps
it) and projected by ``linear_2(act(linear_1(x)))`` to the language model's width (any decoder
family of ``text_config``). Placing the features at the image tokens, the refusal of a prompt
that does not hold them, generation and checkpoint names: ``redco_zoo_models.image_text``.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from redco_zoo_models.clip_vision import CLIPVisionConfig, CLIPVisionModel
from redco_zoo_models.decoder import DecoderLM
from redco_zoo_models.decoder_config import DecoderConfig
from redco_zoo_models.image_text import ImageTextModel
from redco_zoo_models.layers import ACTIVATIONS

READS = {"image_token_index": 32000, "image_seq_length": 576, "projector_hidden_act": "gelu",
         "vision_feature_select_strategy": "default", "vision_feature_layer": -2,
         "multimodal_projector_bias": True}
METADATA = {"model_type", "architectures", "dtype", "torch_dtype", "transformers_version",
            "text_config", "vision_config", "tie_word_embeddings", "ignore_index", "vocab_size",
            "pad_token_id", "use_cache", "image_token_id"}


@dataclasses.dataclass(frozen=True)
class LlavaConfig:
    vision: CLIPVisionConfig = CLIPVisionConfig()
    text: DecoderConfig = DecoderConfig()
    image_token_index: int = 32000
    image_seq_length: int = 576  # (the processor's placeholders per image)
    projector_hidden_act: str = "gelu"
    vision_feature_select_strategy: str = "default"
    vision_feature_layer: int | tuple[int, ...] = -2
    multimodal_projector_bias: bool = True

    # what from_hf / to_hf read and write (LLaVA-OneVision's subclass: its own)
    MODEL_TYPE, ARCHITECTURE, TEXT_TYPE = "llava", "LlavaForConditionalGeneration", "llama"
    HF_READS, HF_METADATA, VISION = READS, METADATA, CLIPVisionConfig

    def __post_init__(self):
        if self.vision_feature_select_strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy "
                             f"{self.vision_feature_select_strategy!r}: 'default' or 'full'.")
        if self.projector_hidden_act not in ACTIVATIONS:
            raise ValueError(f"projector_hidden_act {self.projector_hidden_act!r} is not one of "
                             f"{sorted(ACTIVATIONS)}.")
        n, layers = self.vision.num_hidden_layers + 1, self.vision_feature_layer
        if any(not -n <= i < n for i in ((layers,) if isinstance(layers, int) else layers)):
            raise ValueError(f"vision_feature_layer {self.vision_feature_layer} is outside the "
                             f"tower's {n} hidden states.")

    def feature_layers(self) -> tuple[int, ...]:
        """The hidden states read, as non-negative indices (0: the embeddings)."""
        layers = self.vision_feature_layer
        n = self.vision.num_hidden_layers + 1
        return tuple(i % n for i in ((layers,) if isinstance(layers, int) else layers))

    def features_per_image(self) -> int:
        return (self.vision.image_size // self.vision.patch_size) ** 2 + \
            (self.vision_feature_select_strategy == "full")

    @classmethod
    def from_hf(cls, config: dict) -> "LlavaConfig":
        """From a ``MODEL_TYPE`` config.json; a top-level key it does not read is refused."""
        unknown = sorted(set(config) - set(cls.HF_READS) - cls.HF_METADATA)
        if unknown:
            raise ValueError(f"config.json has keys the zoo's {cls.ARCHITECTURE} does not read: "
                             f"{unknown}.")
        text = {"model_type": cls.TEXT_TYPE, **config.get("text_config", {})}
        kwargs = {k: config.get(k, d) for k, d in cls.HF_READS.items()}
        kwargs["image_token_index"] = config.get("image_token_id", kwargs["image_token_index"])
        kwargs = {k: _tupled(v) for k, v in kwargs.items()}  # (JSON's lists: hashable)
        return cls(cls.VISION.from_hf(config.get("vision_config", {})),
                   DecoderConfig.from_hf(text), **kwargs)

    def to_hf(self) -> dict:
        text = self.text.to_hf()
        reads = {k: _listed(getattr(self, k)) for k in self.HF_READS}
        return {"model_type": self.MODEL_TYPE, "architectures": [self.ARCHITECTURE],
                "vision_config": self.vision.to_hf(), "text_config": text,
                "tie_word_embeddings": text.get("tie_word_embeddings", False), **reads}


def _tupled(value):
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value


def _listed(value):
    return [_listed(v) for v in value] if isinstance(value, tuple) else value


class Projector(nnx.Module):
    """``linear_2(act(linear_1(features)))``: image features to the language model's width."""

    def __init__(self, cfg: LlavaConfig, rngs: nnx.Rngs):
        n_in = cfg.vision.hidden_size * len(cfg.feature_layers())
        width, bias = cfg.text.hidden_size, cfg.multimodal_projector_bias
        self.linear_1 = nnx.Linear(n_in, width, use_bias=bias, rngs=rngs)
        self.linear_2 = nnx.Linear(width, width, use_bias=bias, rngs=rngs)
        self.act = cfg.projector_hidden_act

    def __call__(self, x):
        return self.linear_2(ACTIVATIONS[self.act](self.linear_1(x)))


class LlavaForConditionalGeneration(ImageTextModel):
    """``__call__(input_ids, attention_mask, pixel_values)``: logits (B, T, vocab)."""
    config_class = LlavaConfig
    tower = CLIPVisionModel  # (LLaVA-OneVision's: SigLIP's)

    def __init__(self, cfg: LlavaConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.vision_tower = self.tower(cfg.vision, rngs)
        self.multi_modal_projector = Projector(cfg, rngs)
        self.language_model = DecoderLM(cfg.text, rngs)
        self.stack_tower(self.vision_tower.encoder)

    def encode(self, pixel_values):
        """The projected features of each image: (images, features_per_image, hidden)."""
        layers = self.cfg.feature_layers()
        states = self.vision_tower.hidden_states(pixel_values, max(layers))
        x = jnp.concatenate([states[i] for i in layers], -1)
        if self.cfg.vision_feature_select_strategy == "default":
            x = x[:, 1:]  # (without the class token)
        return self.multi_modal_projector(x)
