"""SigLIP's vision tower in Flax NNX, as Gemma 3 uses it: CLIP's layers without a class token.

The image is cut into patches by a strided conv (with a bias) and learned positions are added
(``vit.patch_sequence`` without a class token); CLIP's pre-norm layers follow
(``redco_zoo_models.clip_vision``: the same names and arithmetic), then ``post_layernorm`` on
every patch. Gemma 3 reads that last hidden state; SigLIP's attention-pooling ``head``
(``vision_use_head``) is not part of it: its tensors are dropped on import (transformers does
not use them either) and the export says ``vision_use_head: false``.
"""
from __future__ import annotations

import dataclasses

from flax import nnx

from redco_zoo_models.clip_vision import CLIPVisionConfig, Encoder, check_pixels
from redco_zoo_models.vit import patch_sequence


@dataclasses.dataclass(frozen=True)
class SiglipVisionConfig(CLIPVisionConfig):
    patch_size: int = 16
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6
    vision_use_head: bool = False  # (read, not built: see the module docstring)

    MODEL_TYPE = "siglip_vision_model"

    def to_hf(self) -> dict:
        return {**super().to_hf(), "vision_use_head": False}


class Embeddings(nnx.Module):
    def __init__(self, cfg: SiglipVisionConfig, rngs: nnx.Rngs):
        p = (cfg.patch_size, cfg.patch_size)
        self.patch_embedding = nnx.Conv(cfg.num_channels, cfg.hidden_size, p, strides=p,
                                        padding="VALID", rngs=rngs)
        self.position_embedding = nnx.Embed((cfg.image_size // cfg.patch_size) ** 2,
                                            cfg.hidden_size, rngs=rngs)
        self.image_size = cfg.image_size

    def __call__(self, pixel_values):
        check_pixels(pixel_values, self.image_size)
        return patch_sequence(self.patch_embedding, None, self.position_embedding.embedding[...],
                              pixel_values)


class SiglipVisionModel(nnx.Module):
    """``__call__(pixel_values)``: the last hidden state (B, patches, hidden), normed."""
    config_class = SiglipVisionConfig

    def __init__(self, cfg: SiglipVisionConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embeddings, self.encoder = Embeddings(cfg, rngs), Encoder(cfg, rngs)
        self.post_layernorm = nnx.LayerNorm(cfg.hidden_size, epsilon=cfg.layer_norm_eps,
                                            rngs=rngs)

    def __call__(self, pixel_values):
        return self.post_layernorm(self.encoder(self.embeddings(pixel_values)))

    def hidden_states(self, pixel_values, n_layers: int) -> list:
        """``[embeddings, after layer 1, ..., after layer n_layers]``, none normed, as
        transformers' ``output_hidden_states`` (what LLaVA-OneVision reads)."""
        return self.encoder.hidden_states(self.embeddings(pixel_values), n_layers)


def without_head(tensors: dict) -> dict:
    """A checkpoint's tensors without SigLIP's pooling head (see the module docstring)."""
    return {k: v for k, v in tensors.items()
            if not k.startswith(("vision_tower.head.", "vision_tower.vision_model.head."))}
