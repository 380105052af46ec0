"""What the zoo's image + text models share (LLaVA ``llava.py``, Gemma 3 ``gemma3_vision.py``):
image features placed at the image tokens, the decoder run on the result, generation, and
checkpoint names.

A model encodes its images (``encode``: (images, features, hidden) in the language model's
width); the prompt holds ``image_token_index`` once per feature (the processor repeats the
image placeholder); the features replace those tokens' embeddings in order, over the whole
batch (transformers' ``masked_scatter``); or, given ``pixel_values`` of rows (B, K, 3, H, W),
each row's image tokens take its own K images' features in order, the images past them (blank
padding, so that every batch has one shape) unused. The zoo's decoder (``redco_zoo_models.decoder``)
reads the embeddings; with ``bidirectional_images`` (Gemma 3) each run of image tokens also
sees itself both ways (``attention.with_blocks``), in a prompt or training row (each row of
the serving engine's prefill its own), not in the decode steps (as transformers). In
generation (``redco_zoo_models.generation``) the images are encoded once and placed at the
prefill; decoded tokens are text.

A prompt whose image-token count is not the features' count is refused (naming both and the
fix) when ``input_ids`` are concrete: in ``__call__`` and ``generate`` outside ``jit``; inside a
jitted step call ``check_inputs`` on the host first. Checkpoint names: transformers' saved
layout (``language_model.model.*``, ``vision_tower.*``, ``multi_modal_projector.*``); its
in-memory layout (``model.language_model.*``) and the hub's ``vision_tower.vision_model.*``
are read too.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

NAMES_IN = [(r"^model\.language_model\.", "language_model.model."),  # transformers' in-memory
            (r"^lm_head\.", "language_model.lm_head."), (r"^model\.", ""),  # names, and the
            (r"^vision_tower\.vision_model\.", "vision_tower.")]  # hub's vision models'


def image_blocks(is_image):
    """(B, T) block ids for ``with_blocks``: each run of image tokens its own id, -1 elsewhere."""
    starts = is_image & ~jnp.pad(is_image, ((0, 0), (1, 0)))[:, :-1]
    return jnp.where(is_image, jnp.cumsum(starts, 1) - 1, -1)


class ImageTextModel(nnx.Module):
    """The shared part; a subclass sets ``vision_tower``, ``multi_modal_projector``,
    ``language_model`` (a ``DecoderLM``) and ``encode``, and its config
    ``features_per_image()`` and ``image_token_index``."""
    bidirectional_images = False

    def stack_tower(self, blocks: nnx.Module) -> None:
        """Under the language model's ``scan_layers``, the tower's blocks (``blocks``: the
        module holding them) stored stacked and scanned as well (``layer_scan``)."""
        if self.cfg.text.scan_layers:
            blocks.stack_blocks()

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

    def check_rows(self, input_ids, per_row: int) -> None:
        """Refuse rows whose image tokens are not whole images' features, or more than
        ``per_row`` images' (skipped for traced ``input_ids``)."""
        if isinstance(input_ids, jax.core.Tracer):
            return
        per_image, token = self.cfg.features_per_image(), self.cfg.image_token_index
        counts = np.sum(np.asarray(input_ids) == token, axis=1)
        if (counts % per_image).any() or (counts > per_row * per_image).any():
            raise ValueError(
                f"rows hold {counts.tolist()} image tokens (id {token}); each must be a whole "
                f"number of images x {per_image} features, at most the row's {per_row} images: "
                "build each row with the model's processor, its images in pixel_values[row].")

    def encode_rows(self, pixel_values):
        """The features of each row's images (B, K, 3, H, W): (B, K * features, hidden)."""
        b, k = pixel_values.shape[:2]
        features = self.encode(pixel_values.reshape(b * k, *pixel_values.shape[2:]))
        return features.reshape(b, -1, features.shape[-1])

    def embed(self, input_ids, features=None, per_row: bool = False, image_mask=None):
        """The decoder's input embeddings, ``features`` (images, n, hidden) placed at the
        image tokens in order (row-major over the batch); ``per_row``: ``features`` (B, n,
        hidden), each row's placed at its own image tokens. ``image_mask`` (B, T): the tokens
        that take features (default: every image token; GRPO's: the prompt's, not an image
        token the model sampled, which was read as text)."""
        return self.place(input_ids, features, self.language_model.model.embed(input_ids),
                          per_row, image_mask)

    def place(self, input_ids, features, x, per_row: bool = False, image_mask=None):
        """``x`` (B, T, hidden) with ``features`` at the image tokens, as ``embed`` places them."""
        if features is None:
            return x
        is_image = input_ids == self.cfg.image_token_index if image_mask is None else image_mask
        if per_row:
            index = jnp.clip(jnp.cumsum(is_image, 1) - 1, 0, features.shape[1] - 1)
            placed = jnp.take_along_axis(features.astype(x.dtype), index[..., None], 1)
            return jnp.where(is_image[..., None], placed, x)
        flat = features.reshape(-1, features.shape[-1]).astype(x.dtype)
        index = jnp.clip(jnp.cumsum(is_image.reshape(-1)) - 1, 0, len(flat) - 1)
        return jnp.where(is_image[..., None], flat[index].reshape(x.shape), x)

    def __call__(self, input_ids, attention_mask=None, pixel_values=None, cache=None,
                 cache_index=0, labels=None, label_mask=None, image_mask=None):
        """As ``DecoderLM.__call__`` (logits, or with ``labels`` the mean loss), the images of
        ``pixel_values`` (images, 3, H, W), or each row's (B, K, 3, H, W), in place of the image
        tokens (``image_mask``: which, as ``embed``); text alone without."""
        per_row = pixel_values is not None and pixel_values.ndim == 5
        if per_row:
            self.check_rows(input_ids, pixel_values.shape[1])
            features = self.encode_rows(pixel_values)
        else:
            self.check_inputs(input_ids, 0 if pixel_values is None else len(pixel_values))
            features = None if pixel_values is None else self.encode(pixel_values)
        return self.language_model(input_ids, attention_mask, cache, cache_index, labels=labels,
                                   label_mask=label_mask,
                                   inputs_embeds=self.embed(input_ids, features, per_row,
                                                            image_mask),
                                   blocks=self._blocks(input_ids, features, image_mask))

    def decode(self, ids, key_valid, cache, cache_index, context=None):
        """One generation step (``redco_zoo_models.generation``); ``context``: ``encode``'s
        features, placed when the prompt is read (``cache_index`` 0), or the serving engine's
        prefill's pixels of each prompt's images (P, K, 3, H, W), placed in its row."""
        if context is not None and context.ndim == 5:  # (each prompt read whole from slot 0)
            embeds = self.embed(ids, self.encode_rows(context), per_row=True)
            blocks = self._blocks(ids, context)  # (each row's own images, both ways)
            return self.language_model(ids, key_valid, cache,
                                       cache_index if blocks is None else 0,
                                       inputs_embeds=embeds, blocks=blocks)
        prefill = isinstance(cache_index, int) and cache_index == 0
        if prefill:
            self.check_inputs(ids, 0 if context is None else len(context))
        embeds = self.embed(ids, context) if prefill else self.language_model.model.embed(ids)
        return self.language_model(ids, key_valid, cache, cache_index, inputs_embeds=embeds,
                                   blocks=self._blocks(ids, context) if prefill else None)

    def _blocks(self, input_ids, features, image_mask=None):
        """The decoder's bidirectional image blocks, with images and ``bidirectional_images``
        (of the tokens that take features: ``image_mask``, as ``embed``), per row."""
        if features is None or not self.bidirectional_images:
            return None
        return image_blocks(input_ids == self.cfg.image_token_index if image_mask is None
                            else image_mask)

    def unserved(self) -> str | None:
        """Why the serving engine (``redco_zoo_models.engine``) cannot run this model yet
        (``None``: it can; its prefill places each prompt's images, ``engine_images``, and
        builds their bidirectional blocks row by row)."""
        return None

    def untrained(self) -> str | None:
        """Why ``redco zoo run sft`` cannot train this model yet (``None``: it can)."""
        return None

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
