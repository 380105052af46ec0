"""Idefics3 and SmolVLM (transformers' ``Idefics3ForConditionalGeneration``,
``SmolVLMForConditionalGeneration``: one architecture) in Flax NNX: image + text in, text out.

The processor (``Idefics3Processor``, ``SmolVLMProcessor``) splits each image into tiles of the
tower's size plus a global tile: ``pixel_values`` (prompts, most tiles, 3, H, W), zeros past a
prompt's tiles, and in the prompt one run of ``image_seq_len`` image tokens a tile. Each tile runs
through SigLIP's tower (``siglip_vision``: the same layers and names; each patch of a whole
tile at its own position: transformers buckets the patches' float32 fractional coordinates,
which gives the same for the published towers' 26, 27 and 32 patches a side, though its CPU
arange puts a patch in its neighbour's bucket at some other sides, e.g. 19 and 25); the last
hidden state, normed, is pixel-shuffled (``scale_factor`` x ``scale_factor`` patches
into one) and projected by a bias-free matrix into a Llama decoder. Each prompt's tiles go to its
own image tokens in order (``image_text``'s rows, (B, K, 3, H, W)); the all-zero tiles are
padding, unused. Tiles of another size than the tower's (``pixel_attention_mask`` not all ones
on a tile: the processor without image splitting) are refused, and so is ``redco zoo run sft``
(``untrained``), before compiling. The serving engine takes a request's tiles
(``engine_image_buckets.TileSlots``: ``max_images`` counts tiles), each row's placed at its own image
tokens in order.
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
from redco_zoo_models.siglip_vision import SiglipVisionConfig, SiglipVisionModel

READS = {"image_token_id": 128257, "scale_factor": 2}
METADATA = {"model_type", "architectures", "dtype", "torch_dtype", "transformers_version",
            "text_config", "vision_config", "tie_word_embeddings", "use_cache", "pad_token_id",
            "_pad_token_id", "vocab_size", "ignore_index"}
NAMES = [("model.text_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."),
         ("model.vision_model.", "vision_model."), ("model.connector.", "connector.")]


@dataclasses.dataclass(frozen=True)
class Idefics3VisionConfig(SiglipVisionConfig):
    image_size: int = 224
    patch_size: int = 32

    MODEL_TYPE = "idefics3_vision"

    def to_hf(self) -> dict:
        return {k: v for k, v in super().to_hf().items() if k != "vision_use_head"}


@dataclasses.dataclass(frozen=True)
class Idefics3Config:
    vision: Idefics3VisionConfig = Idefics3VisionConfig()
    text: DecoderConfig = DecoderConfig()
    image_token_id: int = 128257
    scale_factor: int = 2
    model_type: str = "idefics3"  # (or "smolvlm": the same model)

    def __post_init__(self):
        side = self.vision.image_size // self.vision.patch_size
        if side % self.scale_factor:
            raise ValueError(f"scale_factor {self.scale_factor} does not divide the tower's "
                             f"{side} patches a side.")

    @property
    def image_token_index(self) -> int:
        return self.image_token_id

    def features_per_image(self) -> int:
        """Image tokens a tile (the processor's ``image_seq_len``)."""
        return (self.vision.image_size // self.vision.patch_size // self.scale_factor) ** 2

    @classmethod
    def from_hf(cls, config: dict) -> "Idefics3Config":
        """From an ``idefics3`` or ``smolvlm`` config.json; a key it does not read is refused."""
        unknown = sorted(set(config) - set(READS) - METADATA)
        if unknown:
            raise ValueError(f"config.json has keys the zoo's Idefics3 does not read: {unknown}.")
        model_type, vision = config.get("model_type", "idefics3"), config.get("vision_config", {})
        if vision.get("model_type", "idefics3_vision") not in ("idefics3_vision", "smolvlm_vision"):
            raise ValueError(f"vision_config is a {vision['model_type']!r} tower; the zoo reads "
                             "Idefics3's (idefics3_vision, smolvlm_vision) here.")
        vision = {**vision, "model_type": "idefics3_vision"}
        return cls(Idefics3VisionConfig.from_hf(vision), DecoderConfig.from_hf(
            {"model_type": "llama", **config.get("text_config", {})}),
            **{k: config.get(k, d) for k, d in READS.items()}, model_type=model_type)

    def to_hf(self) -> dict:
        text, vision = self.text.to_hf(), self.vision.to_hf()
        if self.model_type == "smolvlm":
            vision["model_type"] = "smolvlm_vision"
        arch = {"idefics3": "Idefics3", "smolvlm": "SmolVLM"}[self.model_type]
        return {"model_type": self.model_type, "architectures": [f"{arch}ForConditionalGeneration"],
                "vision_config": vision, "text_config": text,
                "tie_word_embeddings": text.get("tie_word_embeddings", False),
                **{k: getattr(self, k) for k in READS}}


class Projection(nnx.Module):
    def __init__(self, n_in: int, n_out: int, rngs: nnx.Rngs):
        self.proj = nnx.Linear(n_in, n_out, use_bias=False, rngs=rngs)


class Connector(nnx.Module):
    """Pixel shuffle (``scale_factor`` squared patches into one), then ``modality_projection``."""

    def __init__(self, cfg: Idefics3Config, rngs: nnx.Rngs):
        n_in = cfg.vision.hidden_size * cfg.scale_factor ** 2
        self.modality_projection = Projection(n_in, cfg.text.hidden_size, rngs)
        self.scale = cfg.scale_factor

    def __call__(self, x):
        b, n, d = x.shape
        side, s = round(n ** 0.5), self.scale
        x = x.reshape(b, side, side // s, d * s).transpose(0, 2, 1, 3)  # (transformers' steps)
        x = x.reshape(b, side // s, side // s, d * s * s).transpose(0, 2, 1, 3)
        return self.modality_projection.proj(x.reshape(b, n // s ** 2, d * s * s))


class Idefics3ForConditionalGeneration(ImageTextModel):
    """``__call__(input_ids, attention_mask, pixel_values, pixel_attention_mask)``: logits."""
    config_class = Idefics3Config
    tiled_images = True  # (the serving engine's slots are tiles: engine_image_buckets.TileSlots)

    def __init__(self, cfg: Idefics3Config, rngs: nnx.Rngs):
        self.cfg = cfg
        self.vision_model = SiglipVisionModel(cfg.vision, rngs)
        self.connector = Connector(cfg, rngs)
        self.language_model = DecoderLM(cfg.text, rngs)
        self.stack_tower(self.vision_model.encoder)

    def encode(self, pixel_values):
        """The projected features of each tile (tiles, 3, H, W): (tiles, features_per_image,
        hidden); given the processor's (prompts, tiles, 3, H, W), of its tiles that are not
        all zeros (host values: ``generate``'s ``encoder_inputs``)."""
        if pixel_values.ndim == 5:
            if isinstance(pixel_values, jax.core.Tracer):
                raise ValueError("pixel_values (prompts, tiles, 3, H, W) are read on the host "
                                 "(padding tiles dropped): pass them outside jax.jit's "
                                 "arguments, or the real tiles as (tiles, 3, H, W).")
            pixel_values = pixel_values.reshape(-1, *pixel_values.shape[2:])
            pixel_values = pixel_values[np.flatnonzero(np.asarray(pixel_values).any((1, 2, 3)))]
        return self.connector(self.vision_model(pixel_values))

    def __call__(self, input_ids, attention_mask=None, pixel_values=None,
                 pixel_attention_mask=None, **rest):
        """As ``ImageTextModel.__call__``; ``pixel_values`` (prompts, tiles, 3, H, W) as the
        processor pads them; ``pixel_attention_mask``: refused unless whole tiles."""
        check_tiles(input_ids, pixel_values, pixel_attention_mask, self.cfg)
        return super().__call__(input_ids, attention_mask, pixel_values, **rest)

    def untrained(self) -> str | None:
        return ("Idefics3/SmolVLM: the SFT pipeline's collate does not split images into its "
                "tiles yet; fine-tune LLaVA, Gemma 3 or Qwen2.5-VL there, or this model through "
                "your own loop.")

    def hf_tensors_in(self, tensors: dict) -> dict:
        for old, new in NAMES:
            tensors = {re.sub("^" + re.escape(old), new, k): v for k, v in tensors.items()}
        return self._language_part(tensors, self.language_model.hf_tensors_in)

    def hf_tensors_out(self, tensors: dict) -> dict:
        tensors = self._language_part(tensors, self.language_model.hf_tensors_out)
        for old, new in NAMES:
            tensors = {re.sub("^" + re.escape(new), old, k): v for k, v in tensors.items()}
        return tensors


def check_tiles(input_ids, pixel_values, pixel_attention_mask, cfg: Idefics3Config) -> None:
    """Refuse (where concrete) tiles that are not the tower's size (part of a tile masked), and
    prompts whose image tokens are not their tiles' (the tiles not all zeros)."""
    if pixel_values is None or pixel_values.ndim != 5 or any(
            isinstance(x, jax.core.Tracer) for x in (input_ids, pixel_values, pixel_attention_mask)):
        return
    real = np.asarray(pixel_values).reshape(*pixel_values.shape[:2], -1).any(-1)
    if pixel_attention_mask is not None:
        mask = np.asarray(pixel_attention_mask).reshape(*real.shape, -1)
        if not mask[real].all():
            raise ValueError("pixel_attention_mask masks part of a tile: the zoo's Idefics3 "
                             "reads whole tiles of the tower's size; keep the processor's "
                             "do_image_splitting=True.")
    found = (np.asarray(input_ids) == cfg.image_token_id).sum(1)
    want = real.sum(1) * cfg.features_per_image()
    if (found != want).any():
        raise ValueError(f"the prompts hold {found.tolist()} image tokens (id "
                         f"{cfg.image_token_id}); their tiles give {want.tolist()} "
                         f"({cfg.features_per_image()} a tile): build them with the model's "
                         "processor (its image_seq_len), from the same images.")
