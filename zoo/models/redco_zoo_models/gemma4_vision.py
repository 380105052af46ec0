"""Gemma 4 with images (transformers' ``Gemma4ForConditionalGeneration``, its vision tower) in
Flax NNX. Unlike Gemma 3's SigLIP (``gemma3_vision``), the tower takes images of any aspect:

* The processor gives each image as ``max_patches`` flattened patches (``pixel_values``, in
  [0, 1], rows past the image's own patches zero) and their (x, y) places
  (``image_position_ids``, (-1, -1) on the padding). A patch is ``2 * (p - 0.5)`` through
  ``input_proj`` (no bias) plus the x-th row of one learned table and the y-th of another.
* Layers: Gemma's four RMSNorms (no offset: ``x / rms(x) * w``), attention whose q and k are
  RMS-normed per head and v normed without a weight, scaled by 1 (not ``1/sqrt(d)``), padding
  keys masked, each half of a head turned by 2-D RoPE (the first half by x, the second by y,
  ``rope_theta`` over a quarter-head of frequencies), and a gated MLP. With
  ``use_clipped_linears`` every projection clamps its input and output to stored bounds.
* Pooler: each ``k x k`` block of patches (``pooling_kernel_size``) averaged to one soft token,
  times ``sqrt(hidden)``; with ``standardize``, ``(x - std_bias) * std_scale``. An image gives
  as many soft tokens as its blocks (fewer than ``max_patches / k^2`` when it is padded).
* Projector (``embed_vision``): an RMSNorm without weight, then ``embedding_projection``.

The language model is the zoo's Gemma 4 decoder (``gemma4_text``): image tokens are looked up as
the pad token (in the per-layer inputs' table too, as transformers does) and their embeddings replaced
by the images' soft tokens in order; with ``use_bidirectional_attention: "vision"`` each run of
image tokens sees itself both ways in the sliding layers only (the full layers stay causal).
The serving engine's prefill gives ``decode`` each prompt's images, padded to one bucket
(``encode_rows``; ``engine_image_buckets.PlacedPatchSlots``), placed and seen both ways per row; the SFT
collate gives ``__call__`` each training row's so (``redco_zoo_sft.gemma4_chat``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from redco_zoo_models import layer_scan
from redco_zoo_models.checkpoint_files import renamed
from redco_zoo_models.decoder import DecoderLM
from redco_zoo_models.gemma4_vision_config import Gemma4VisionConfig, Gemma4VisionTowerConfig
from redco_zoo_models.image_text import ImageTextModel
from redco_zoo_models.layers import ACTIVATIONS, RMSNorm, rms_normalized


class ClippableLinear(nnx.Module):
    """A bias-free projection (``linear``); with ``clipped``, its input and output clamped to
    ``input_min..input_max`` and ``output_min..output_max``."""

    def __init__(self, n_in: int, n_out: int, clipped: bool, rngs: nnx.Rngs):
        self.linear = nnx.Linear(n_in, n_out, use_bias=False, rngs=rngs)
        self.clipped = clipped
        if clipped:
            self.input_min, self.output_min = (nnx.Param(jnp.asarray(-jnp.inf)) for _ in "io")
            self.input_max, self.output_max = (nnx.Param(jnp.asarray(jnp.inf)) for _ in "io")

    def __call__(self, x):
        if not self.clipped:
            return self.linear(x)
        x = jnp.clip(x, self.input_min[...], self.input_max[...])
        return jnp.clip(self.linear(x), self.output_min[...], self.output_max[...])


def rotate_2d(x, angles):
    """Each half of ``x``'s heads (B, n, heads, d) turned by its axis' ``angles`` (B, n, 2,
    d/4), rotate-half style within the half."""
    halves = []
    for axis, part in enumerate(jnp.split(x, 2, -1)):
        a = jnp.concatenate([angles[..., axis, :]] * 2, -1)[:, :, None, :]
        one, two = jnp.split(part, 2, -1)
        cos, sin = jnp.cos(a).astype(x.dtype), jnp.sin(a).astype(x.dtype)  # (x's dtype: bf16)
        halves.append(part * cos + jnp.concatenate([-two, one], -1) * sin)
    return jnp.concatenate(halves, -1)


class Attention(nnx.Module):
    def __init__(self, cfg: Gemma4VisionTowerConfig, rngs: nnx.Rngs):
        h, d, kv, clip = cfg.hidden_size, cfg.head_dim, cfg.num_key_value_heads, \
            cfg.use_clipped_linears
        self.q_proj = ClippableLinear(h, cfg.num_attention_heads * d, clip, rngs)
        self.k_proj = ClippableLinear(h, kv * d, clip, rngs)
        self.v_proj = ClippableLinear(h, kv * d, clip, rngs)
        self.o_proj = ClippableLinear(cfg.num_attention_heads * d, h, clip, rngs)
        self.q_norm, self.k_norm = RMSNorm(d, cfg.rms_norm_eps), RMSNorm(d, cfg.rms_norm_eps)
        self.cfg = cfg

    def __call__(self, x, angles, valid):
        b, n, _ = x.shape
        d, eps = self.cfg.head_dim, self.cfg.rms_norm_eps
        q = rotate_2d(self.q_norm(self.q_proj(x).reshape(b, n, -1, d)), angles)
        k = rotate_2d(self.k_norm(self.k_proj(x).reshape(b, n, -1, d)), angles)
        v = rms_normalized(self.v_proj(x).reshape(b, n, -1, d), eps)
        groups = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, groups, 2), jnp.repeat(v, groups, 2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k)  # (scale 1: q and k are normed)
        scores = jnp.where(valid[:, None, None, :], scores, jnp.finfo(scores.dtype).min)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v)
        return self.o_proj(out.reshape(b, n, -1))


class Layer(nnx.Module):
    def __init__(self, cfg: Gemma4VisionTowerConfig, rngs: nnx.Rngs):
        h, m, clip = cfg.hidden_size, cfg.intermediate_size, cfg.use_clipped_linears
        norm = lambda: RMSNorm(h, cfg.rms_norm_eps)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.self_attn = Attention(cfg, rngs)
        self.mlp = nnx.Dict(gate_proj=ClippableLinear(h, m, clip, rngs),
                            up_proj=ClippableLinear(h, m, clip, rngs),
                            down_proj=ClippableLinear(m, h, clip, rngs))
        self.act = ACTIVATIONS[cfg.hidden_activation]

    def __call__(self, x, angles, valid):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), angles,
                                                             valid))
        h, mlp = self.pre_feedforward_layernorm(x), self.mlp
        h = mlp["down_proj"](self.act(mlp["gate_proj"](h)) * mlp["up_proj"](h))
        return x + self.post_feedforward_layernorm(h)


class Gemma4VisionModel(nnx.Module):
    """``__call__(pixel_values, image_position_ids)``: ``(soft tokens (images, slots, hidden),
    which slots are real (images, slots))``."""

    def __init__(self, cfg: Gemma4VisionTowerConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.patch_embedder = nnx.Dict(input_proj=nnx.Linear(
            3 * cfg.patch_size ** 2, cfg.hidden_size, use_bias=False, rngs=rngs))
        self.patch_embedder["position_embedding_table"] = nnx.Param(jnp.ones(
            (2, cfg.position_embedding_size, cfg.hidden_size)))
        self.encoder = nnx.Dict(layers=nnx.List([Layer(cfg, rngs)
                                                 for _ in range(cfg.num_hidden_layers)]))
        self.runs = None  # stacked by ``stack_blocks``
        if cfg.standardize:
            self.std_bias = nnx.Param(jnp.zeros(cfg.hidden_size))
            self.std_scale = nnx.Param(jnp.ones(cfg.hidden_size))

    def stack_blocks(self) -> None:
        """The layers stored stacked, run under a scan (``layer_scan``; ``scan_layers``)."""
        self.encoder["layers"], self.runs = layer_scan.stacked(list(self.encoder["layers"]))

    def __call__(self, pixel_values, image_position_ids):
        pad = (image_position_ids == -1).all(-1)
        places = jnp.maximum(image_position_ids, 0)
        table = self.patch_embedder["position_embedding_table"][...]
        x = self.patch_embedder["input_proj"]((2 * (pixel_values - 0.5)).astype(table.dtype))
        x = x + jnp.where(pad[..., None], 0, table[0][places[..., 0]] + table[1][places[..., 1]])
        quarter = self.cfg.head_dim // 4
        inv_freq = self.cfg.rope_theta ** (-jnp.arange(quarter, dtype=jnp.float32) / quarter)
        angles = places[..., None].astype(jnp.float32) * inv_freq  # (B, n, 2, d/4)
        x, _ = layer_scan.blocks(self.encoder["layers"], self.runs,
                                 lambda layer, h: layer(h, angles, ~pad), x)
        return self.pool(jnp.where(pad[..., None], 0, x), places)

    def pool(self, x, places):
        """Each ``k x k`` block of patches averaged (times ``sqrt(hidden)``) into its slot."""
        k = self.cfg.pooling_kernel_size
        slots = x.shape[1] // k ** 2
        columns = (places[..., 0].max(-1, keepdims=True) + 1) // k
        slot = places[..., 0] // k + columns * (places[..., 1] // k)
        weights = jax.nn.one_hot(slot, slots, dtype=jnp.float32) / k ** 2  # (B, n, slots)
        pooled = jnp.einsum("bns,bnd->bsd", weights, x.astype(jnp.float32))
        pooled = pooled * self.cfg.hidden_size ** 0.5
        if self.cfg.standardize:
            pooled = (pooled - self.std_bias[...]) * self.std_scale[...]
        return pooled.astype(x.dtype), (weights > 0).any(1)


class Projector(nnx.Module):
    """``embed_vision``: an RMSNorm without weight, then a bias-free projection."""

    def __init__(self, cfg: Gemma4VisionConfig, rngs: nnx.Rngs):
        self.embedding_projection = nnx.Linear(cfg.vision.hidden_size, cfg.text.hidden_size,
                                               use_bias=False, rngs=rngs)
        self.eps = cfg.vision.rms_norm_eps

    def __call__(self, x):
        return self.embedding_projection(rms_normalized(x, self.eps))


class Gemma4ForConditionalGeneration(ImageTextModel):
    """``__call__(input_ids, attention_mask, pixel_values, image_position_ids)``: logits."""
    config_class = Gemma4VisionConfig
    placed_patches = True  # (the serving engine's prompts: engine_image_buckets.PlacedPatchSlots)

    def __init__(self, cfg: Gemma4VisionConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.bidirectional_images = cfg.bidirectional
        self.vision_tower = Gemma4VisionModel(cfg.vision, rngs)
        self.embed_vision = Projector(cfg, rngs)
        self.language_model = DecoderLM(cfg.text, rngs)
        self.stack_tower(self.vision_tower)

    def encode(self, pixel_values, image_position_ids):
        """Every image's soft tokens in order, in the language model's width (tokens, hidden);
        the slots past a padded image's own blocks dropped (a stable sort moves them last,
        where no image token reads them)."""
        features, real = self.vision_tower(pixel_values, image_position_ids)
        order = jnp.argsort(~real.reshape(-1), stable=True)
        return self.embed_vision(features.reshape(-1, features.shape[-1])[order])

    def check_tokens(self, input_ids, image_position_ids) -> None:
        """Refuse a prompt whose image tokens are not the images' soft tokens (skipped when
        traced)."""
        if any(isinstance(a, jax.core.Tracer) for a in (input_ids, image_position_ids)):
            return
        k2 = self.cfg.vision.pooling_kernel_size ** 2
        real = (np.asarray(image_position_ids) != -1).all(-1).sum(-1) // k2
        n = int(np.sum(np.asarray(input_ids) == self.cfg.image_token_id))
        if n != int(real.sum()):
            raise ValueError(f"input_ids hold {n} image tokens (id {self.cfg.image_token_id}) "
                             f"but the images give {real.tolist()} soft tokens: build the "
                             "prompt with the model's processor.")

    def text_ids(self, input_ids):
        """The ids the decoder looks up: image tokens as the pad token (as transformers)."""
        pad = self.cfg.text.pad_token_id or 0
        return jnp.where(input_ids == self.cfg.image_token_id, pad, input_ids)

    def __call__(self, input_ids, attention_mask=None, pixel_values=None,
                 image_position_ids=None, labels=None, label_mask=None):
        """Logits (or with ``labels`` the mean loss); text alone without ``pixel_values``. The
        processor's images (images, n, features) are placed in order over the batch; rows of
        images (B, K, n, features), as the SFT collate pads them (``encode_rows``), each in its
        row, its image blocks both ways in that row."""
        features, rows = None, pixel_values is not None and pixel_values.ndim == 4
        if pixel_values is not None:
            self.check_tokens(input_ids, image_position_ids)
            features = (self.encode_rows if rows else self.encode)(pixel_values,
                                                                   image_position_ids)
        ids = self.text_ids(input_ids)
        return self.language_model(ids, attention_mask, labels=labels, label_mask=label_mask,
                                   inputs_embeds=self.place(input_ids, features,
                                                            self.language_model.model.embed(ids),
                                                            rows),
                                   blocks=self._blocks(input_ids, features))

    def encode_rows(self, pixel_values, image_position_ids):
        """Each row's soft tokens in order (B, K * slots, hidden) from its K images' padded
        patches (B, K, n, features) and places (B, K, n, 2); a blank image (every place -1)
        gives none (its slots, and each image's past its own blocks, moved last)."""
        b, k = pixel_values.shape[:2]
        features, real = self.vision_tower(pixel_values.reshape(b * k, *pixel_values.shape[2:]),
                                           image_position_ids.reshape(
                                               b * k, *image_position_ids.shape[2:]))
        real = real & (image_position_ids != -1).any((-1, -2)).reshape(b * k, 1)
        features = features.reshape(b, -1, features.shape[-1])
        order = jnp.argsort(~real.reshape(b, -1), axis=1, stable=True)
        return self.embed_vision(jnp.take_along_axis(features, order[..., None], 1))

    def decode(self, ids, key_valid, cache, cache_index, context=None):
        """One generation step (``redco_zoo_models.generation``); ``context``: ``encode``'s
        soft tokens, placed when the prompt is read; or the serving engine's prefill's
        (``engine_image_buckets.PlacedPatchSlots``: each prompt's padded patches and their places),
        each row's placed in that row, its image blocks both ways in that row only."""
        text = self.text_ids(ids)
        embeds = self.language_model.model.embed(text)
        if isinstance(context, dict):  # (each prompt read whole from slot 0)
            features = self.encode_rows(context["pixel_values"], context["image_position_ids"])
            blocks = self._blocks(ids, features)
            return self.language_model(text, key_valid, cache,
                                       cache_index if blocks is None else 0,
                                       inputs_embeds=self.place(ids, features, embeds, True),
                                       blocks=blocks)
        prefill = isinstance(cache_index, int) and cache_index == 0 and context is not None
        if prefill:
            embeds = self.place(ids, context, embeds)
        return self.language_model(text, key_valid, cache, cache_index, inputs_embeds=embeds,
                                   blocks=self._blocks(ids, context) if prefill else None)

    def hf_tensors_in(self, tensors: dict) -> dict:
        return super().hf_tensors_in({k.replace("model.vision_tower.", "vision_tower.", 1)
                                      .replace("model.embed_vision.", "embed_vision.", 1): v
                                      for k, v in tensors.items()})

    def hf_tensors_out(self, tensors: dict) -> dict:
        tensors = super().hf_tensors_out(tensors)
        names = [("language_model.model.", "model.language_model."),
                 ("language_model.lm_head.", "lm_head."),
                 ("vision_tower.", "model.vision_tower."), ("embed_vision.", "model.embed_vision.")]
        return renamed(tensors, names)
