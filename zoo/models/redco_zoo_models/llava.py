"""LLaVA (transformers' ``LlavaForConditionalGeneration``) in Flax NNX: image + text in, text out.

Each image (``pixel_values`` (images, 3, H, W), made on the host by the model's own
transformers image processor) runs through CLIP's vision tower
(``redco_zoo_models.clip_vision``); the hidden state(s) at ``vision_feature_layer`` (-2 by
default: the input of the last layer; a list: concatenated over the hidden size) are taken
without the class token (``vision_feature_select_strategy`` ``"default"``; ``"full"`` keeps
it) and projected by ``linear_2(act(linear_1(x)))`` to the language model's width. The prompt
holds ``image_token_index`` once per feature (the processor repeats the ``<image>``
placeholder); the features replace those tokens' embeddings in order, over the whole batch
(transformers' ``masked_scatter``), and the zoo's decoder (``redco_zoo_models.decoder``, any
family of ``text_config``) reads the embeddings. In generation (``redco_zoo_models.generation``)
the images are encoded once (``encode``) and placed at the prefill; decoded tokens are text.

A prompt whose image-token count is not the features' count is refused (naming both and the
fix) when ``input_ids`` are concrete: in ``__call__`` and ``generate`` outside ``jit``; inside
a jitted step call ``check_inputs`` on the host first. Checkpoint names: transformers' saved
layout (``language_model.model.*``, ``vision_tower.*``, ``multi_modal_projector.*``); its
in-memory layout (``model.language_model.*``) and the hub's ``vision_tower.vision_model.*``
are read too.
"""
from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from redco_zoo_models.clip_vision import CLIPVisionConfig, CLIPVisionModel
from redco_zoo_models.decoder import DecoderLM
from redco_zoo_models.decoder_config import DecoderConfig
from redco_zoo_models.layers import ACTIVATIONS

READS = {"image_token_index": 32000, "image_seq_length": 576, "projector_hidden_act": "gelu",
         "vision_feature_select_strategy": "default", "vision_feature_layer": -2,
         "multimodal_projector_bias": True}
METADATA = {"model_type", "architectures", "dtype", "torch_dtype", "transformers_version",
            "text_config", "vision_config", "tie_word_embeddings", "ignore_index", "vocab_size",
            "pad_token_id", "use_cache", "image_token_id"}
NAMES_IN = [(r"^model\.language_model\.", "language_model.model."),  # transformers' in-memory
            (r"^lm_head\.", "language_model.lm_head."), (r"^model\.", ""),  # names, and the
            (r"^vision_tower\.vision_model\.", "vision_tower.")]  # hub's CLIPVisionModel's


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

    def __post_init__(self):
        if self.vision_feature_select_strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy "
                             f"{self.vision_feature_select_strategy!r}: 'default' or 'full'.")
        if self.projector_hidden_act not in ACTIVATIONS:
            raise ValueError(f"projector_hidden_act {self.projector_hidden_act!r} is not one of "
                             f"{sorted(ACTIVATIONS)}.")
        n = self.vision.num_hidden_layers + 1
        if any(not -n <= i < n for i in self.feature_layers()):
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
        """From a ``llava`` config.json; a top-level key it does not read is refused."""
        unknown = sorted(set(config) - set(READS) - METADATA)
        if unknown:
            raise ValueError(f"config.json has keys the zoo's LLaVA does not read: {unknown}.")
        text = {"model_type": "llama", **config.get("text_config", {})}
        kwargs = {k: config.get(k, d) for k, d in READS.items()}
        kwargs["image_token_index"] = config.get("image_token_id", kwargs["image_token_index"])
        if isinstance(kwargs["vision_feature_layer"], list):
            kwargs["vision_feature_layer"] = tuple(kwargs["vision_feature_layer"])
        return cls(CLIPVisionConfig.from_hf(config.get("vision_config", {})),
                   DecoderConfig.from_hf(text), **kwargs)

    def to_hf(self) -> dict:
        text = self.text.to_hf()
        reads = {k: getattr(self, k) for k in READS}
        if isinstance(self.vision_feature_layer, tuple):
            reads["vision_feature_layer"] = list(self.vision_feature_layer)
        return {"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"],
                "vision_config": self.vision.to_hf(), "text_config": text,
                "tie_word_embeddings": text.get("tie_word_embeddings", False), **reads}


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


class LlavaForConditionalGeneration(nnx.Module):
    """``__call__(input_ids, attention_mask, pixel_values)``: logits (B, T, vocab)."""
    config_class = LlavaConfig

    def __init__(self, cfg: LlavaConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.vision_tower = CLIPVisionModel(cfg.vision, rngs)
        self.multi_modal_projector = Projector(cfg, rngs)
        self.language_model = DecoderLM(cfg.text, rngs)

    def encode(self, pixel_values):
        """The projected features of each image: (images, features_per_image, hidden)."""
        layers = self.cfg.feature_layers()
        states = self.vision_tower.hidden_states(pixel_values, max(layers))
        x = jnp.concatenate([states[i] for i in layers], -1)
        if self.cfg.vision_feature_select_strategy == "default":
            x = x[:, 1:]  # (without the class token)
        return self.multi_modal_projector(x)

    def check_inputs(self, input_ids, n_images: int) -> None:
        """Refuse a prompt whose image tokens are not ``n_images`` images' features (skipped
        for traced ``input_ids``: call it on the host before a jitted step)."""
        if isinstance(input_ids, jax.core.Tracer):
            return
        per_image, token = self.cfg.features_per_image(), self.cfg.image_token_index
        n_tokens = int(np.sum(np.asarray(input_ids) == token))
        if n_tokens != n_images * per_image:
            raise ValueError(
                f"input_ids hold {n_tokens} image tokens (id {token}) but pixel_values give "
                f"{n_images} images x {per_image} features = {n_images * per_image}: build the "
                f"prompt with the model's processor (one <image> placeholder per image, each "
                f"expanded to {per_image} image tokens), or pass one image per placeholder.")

    def embed(self, input_ids, features=None):
        """The decoder's input embeddings, ``features`` (images, n, hidden) placed at the
        image tokens in order (row-major over the batch)."""
        x = self.language_model.model.embed(input_ids)
        if features is None:
            return x
        is_image = input_ids == self.cfg.image_token_index
        flat = features.reshape(-1, features.shape[-1]).astype(x.dtype)
        index = jnp.clip(jnp.cumsum(is_image.reshape(-1)) - 1, 0, len(flat) - 1)
        return jnp.where(is_image[..., None], flat[index].reshape(x.shape), x)

    def __call__(self, input_ids, attention_mask=None, pixel_values=None, cache=None,
                 cache_index=0, labels=None, label_mask=None):
        """As ``DecoderLM.__call__`` (logits, or with ``labels`` the mean loss), the images of
        ``pixel_values`` (images, 3, H, W) in place of the image tokens; text alone without."""
        self.check_inputs(input_ids, 0 if pixel_values is None else len(pixel_values))
        features = None if pixel_values is None else self.encode(pixel_values)
        return self.language_model(input_ids, attention_mask, cache, cache_index, labels=labels,
                                   label_mask=label_mask,
                                   inputs_embeds=self.embed(input_ids, features))

    def decode(self, ids, key_valid, cache, cache_index, context=None):
        """One generation step (``redco_zoo_models.generation``); ``context``: ``encode``'s
        features, placed when the prompt is read (``cache_index`` 0)."""
        prefill = isinstance(cache_index, int) and cache_index == 0
        if prefill:
            self.check_inputs(ids, 0 if context is None else len(context))
        embeds = self.embed(ids, context) if prefill else self.language_model.model.embed(ids)
        return self.language_model(ids, key_valid, cache, cache_index, inputs_embeds=embeds)

    def init_cache(self, batch: int, n_slots: int, dtype=jnp.float32) -> list[dict]:
        return self.language_model.init_cache(batch, n_slots, dtype)

    def rereads_at(self) -> int | None:
        return self.language_model.rereads_at()

    def hf_tensors_in(self, tensors: dict) -> dict:
        """A checkpoint's tensors under this model's names (any of the layouts above)."""
        for pattern, name in NAMES_IN:
            tensors = {re.sub(pattern, name, k): v for k, v in tensors.items()}
        return self._language_part(tensors, self.language_model.hf_tensors_in)

    def hf_tensors_out(self, tensors: dict) -> dict:
        return self._language_part(tensors, self.language_model.hf_tensors_out)

    @staticmethod
    def _language_part(tensors: dict, convert) -> dict:
        """``tensors`` with the language model's (``language_model.*``) through ``convert``."""
        prefix = "language_model."
        inner = convert({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})
        return {**{k: v for k, v in tensors.items() if not k.startswith(prefix)},
                **{prefix + k: v for k, v in inner.items()}}
