"""The configs of Llama 4 with images (``redco_zoo_models.llama4_vision``): the tower's
(``vision_config``, transformers' ``Llama4VisionConfig``) and the whole model's (a ``llama4``
config.json with a ``vision_config``; its ``text_config`` the zoo's ``llama4_text`` decoder).

transformers' tower hard-codes exact GELU, LayerNorms at eps 1e-5 and bias-free adapter and
projector, whatever ``hidden_act``, ``norm_eps`` and ``multi_modal_projector_bias`` say: those
keys are read as metadata here too. Shapes the tower cannot chain are refused, naming them.
"""
from __future__ import annotations

import dataclasses

from redco_zoo_models.decoder_config import DecoderConfig
from redco_zoo_models.family_config import text_part

TOWER_METADATA = {"model_type", "hidden_act", "norm_eps", "initializer_range",
                  "vision_feature_select_strategy", "multi_modal_projector_bias",
                  "projector_dropout", "attention_dropout", "dtype", "torch_dtype",
                  "transformers_version", "architectures", "vision_feature_layer"}
READS = {"boi_token_index": 200080, "eoi_token_index": 200081, "image_token_index": 200092}
METADATA = {"model_type", "architectures", "dtype", "torch_dtype", "transformers_version",
            "text_config", "vision_config", "tie_word_embeddings", "pad_token_id", "use_cache"}


@dataclasses.dataclass(frozen=True)
class Llama4TowerConfig:
    hidden_size: int = 1408
    intermediate_size: int = 5632
    num_hidden_layers: int = 34
    num_attention_heads: int = 16
    num_channels: int = 3
    image_size: int = 336
    patch_size: int = 14
    pixel_shuffle_ratio: float = 0.5
    projector_input_dim: int = 4096
    projector_output_dim: int = 4096
    vision_output_dim: int = 4096
    rope_theta: float = 10000.0

    MODEL_TYPE = "llama4_vision_model"

    def __post_init__(self):
        k = round(1 / self.pixel_shuffle_ratio)
        shuffled = self.hidden_size * k * k
        problems = [
            (self.patches_per_side() % k, f"{self.patches_per_side()} patches a side are not "
                                          f"a multiple of 1 / pixel_shuffle_ratio ({k})"),
            (shuffled != self.intermediate_size, f"the adapter's fc1 reads intermediate_size "
                                                 f"{self.intermediate_size} features, the pixel "
                                                 f"shuffle gives {shuffled}"),
            (self.projector_input_dim != self.projector_output_dim,
             "projector_input_dim and projector_output_dim differ (fc2 reads fc1's output)"),
            (self.vision_output_dim != self.projector_output_dim,
             "vision_output_dim is not projector_output_dim (the projector reads the adapter)")]
        for bad, why in problems:
            if bad:
                raise ValueError(f"vision_config: {why}.")

    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    def tokens_per_tile(self) -> int:
        return round(self.patches_per_side() * self.pixel_shuffle_ratio) ** 2

    @classmethod
    def from_hf(cls, config: dict) -> "Llama4TowerConfig":
        """From a ``vision_config`` (``rope_theta`` at its top, as the hub's, or in
        ``rope_parameters``, as transformers 5 writes it); a key that would change the tower
        and that it does not read is refused."""
        if config.get("model_type", cls.MODEL_TYPE) != cls.MODEL_TYPE:
            raise ValueError(f"vision_config is a {config['model_type']!r} tower; Llama 4 "
                             f"reads {cls.MODEL_TYPE}.")
        fields = {f.name for f in dataclasses.fields(cls)} - {"rope_theta"}
        unknown = sorted(set(config) - fields - TOWER_METADATA - {"rope_parameters",
                                                                  "rope_theta"})
        if unknown:
            raise ValueError(f"vision_config has keys the zoo's Llama 4 tower does not read: "
                             f"{unknown}.")
        rope = config.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"vision_config's rope_type {rope['rope_type']!r}: the tower's "
                             "2-D RoPE is 'default'.")
        theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        return cls(**{k: v for k, v in config.items() if k in fields}, rope_theta=theta)

    def to_hf(self) -> dict:
        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "rope_theta"}
        return {"model_type": self.MODEL_TYPE, **out,
                "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta}}


@dataclasses.dataclass(frozen=True)
class Llama4ImageConfig:
    vision: Llama4TowerConfig = Llama4TowerConfig()
    text: DecoderConfig = DecoderConfig()
    boi_token_index: int = 200080
    eoi_token_index: int = 200081
    image_token_index: int = 200092  # (``<|patch|>``: one per feature)

    def features_per_image(self) -> int:
        """Tokens per tile (what ``image_text`` calls an image: a row of ``pixel_values``)."""
        return self.vision.tokens_per_tile()

    @classmethod
    def from_hf(cls, config: dict) -> "Llama4ImageConfig":
        """From a ``llama4`` config.json with a ``vision_config``; a top-level key it does not
        read is refused."""
        unknown = sorted(set(config) - set(READS) - METADATA)
        if unknown:
            raise ValueError(f"config.json has keys the zoo's Llama 4 with images does not "
                             f"read: {unknown}.")
        return cls(Llama4TowerConfig.from_hf(config.get("vision_config", {})),
                   DecoderConfig.from_hf(text_part({**config, "model_type": "llama4"})),
                   **{k: config.get(k, d) for k, d in READS.items()})

    def to_hf(self) -> dict:
        text = self.text.to_hf()
        return {"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"],
                "vision_config": self.vision.to_hf(), "text_config": text,
                "tie_word_embeddings": text.get("tie_word_embeddings", False),
                **{k: getattr(self, k) for k in READS}}
