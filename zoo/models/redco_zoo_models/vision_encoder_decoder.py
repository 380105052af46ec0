"""HuggingFace's ``VisionEncoderDecoderModel`` in Flax NNX: a ViT encoder and a GPT-2 decoder that
cross-attends to the image (image captioning, OCR). Names as HuggingFace's: ``encoder.*``,
``decoder.*`` and, where the hidden sizes differ, ``enc_to_dec_proj``.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from redco_zoo_models.gpt2 import GPT2Config, GPT2LMHeadModel
from redco_zoo_models.vit import ViTConfig, ViTModel


@dataclasses.dataclass(frozen=True)
class VisionEncoderDecoderConfig:
    encoder: ViTConfig = ViTConfig()
    decoder: GPT2Config = GPT2Config(add_cross_attention=True)
    decoder_start_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        if not self.decoder.add_cross_attention:
            raise ValueError("the decoder needs add_cross_attention=True")

    @classmethod
    def from_hf(cls, config: dict) -> "VisionEncoderDecoderConfig":
        """From a HuggingFace ``vision-encoder-decoder`` ``config.json`` (ViT and GPT-2 only)."""
        kinds = (config["encoder"].get("model_type"), config["decoder"].get("model_type"))
        if kinds != ("vit", "gpt2"):
            raise ValueError(f"only a ViT encoder and a GPT-2 decoder are supported, not {kinds}")
        return cls(ViTConfig.from_hf(config["encoder"]), GPT2Config.from_hf(config["decoder"]),
                   config.get("decoder_start_token_id"), config.get("pad_token_id"))

    def to_hf(self) -> dict:
        extra = {k: v for k, v in (("decoder_start_token_id", self.decoder_start_token_id),
                                   ("pad_token_id", self.pad_token_id)) if v is not None}
        return {"model_type": "vision-encoder-decoder",
                "architectures": ["VisionEncoderDecoderModel"], "is_encoder_decoder": True,
                "tie_word_embeddings": False, "encoder": self.encoder.to_hf(),
                "decoder": self.decoder.to_hf(), **extra}


class VisionEncoderDecoderModel(nnx.Module):
    config_class = VisionEncoderDecoderConfig

    def __init__(self, cfg: VisionEncoderDecoderConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.encoder = ViTModel(cfg.encoder, rngs)  # with HuggingFace's (unused) pooler
        self.decoder = GPT2LMHeadModel(cfg.decoder, rngs)
        if cfg.encoder.hidden_size != cfg.decoder.n_embd:
            self.enc_to_dec_proj = nnx.Linear(cfg.encoder.hidden_size, cfg.decoder.n_embd,
                                              rngs=rngs)

    def __call__(self, pixel_values, decoder_input_ids, decoder_attention_mask=None):
        """Decoder logits (B, T, vocab) for images (B, C, H, W) and decoder token ids (B, T)."""
        return self.decoder(decoder_input_ids, decoder_attention_mask,
                            encoder_hidden_states=self.encode(pixel_values))

    def encode(self, pixel_values):
        """The encoder's states (B, S, decoder hidden size) the decoder cross-attends to."""
        context = self.encoder(pixel_values)
        return self.enc_to_dec_proj(context) if hasattr(self, "enc_to_dec_proj") else context

    def decode(self, ids, key_valid, cache, cache_index, context):
        """One generation step (``redco_zoo_models.generation``)."""
        return self.decoder.decode(ids, key_valid, cache, cache_index, context)

    def init_cache(self, batch: int, n_slots: int, dtype=jnp.float32) -> list[dict]:
        return self.decoder.init_cache(batch, n_slots, dtype)
