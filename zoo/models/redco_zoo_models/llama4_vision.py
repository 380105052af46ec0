"""Llama 4 with images (transformers' ``Llama4ForConditionalGeneration``) in Flax NNX.

Its image processor cuts an image into tiles of ``image_size`` (a grid of them, then the
whole image resized to one more, the global tile, when the grid has more than one), each
tile a row of ``pixel_values`` (tiles, 3, S, S). The tower reads each tile alone:

* Patches cut as ``torch.nn.Unfold`` does (channel-major within a patch) through
  ``patch_embedding.linear`` (no bias); the class embedding goes LAST, then the learned
  ``positional_embedding_vlm`` (one row per patch and the class token), ``layernorm_pre``.
* Pre-norm layers ``x + attn(input_layernorm(x))``, ``x + fc2(gelu(fc1(post_attention_
  layernorm(x))))`` (LayerNorms at eps 1e-5, exact GELU, biases everywhere), full attention
  scaled by ``head_dim ** -0.5`` with the vision 2-D RoPE on q and k: feature pairs
  ``(2i, 2i+1)`` turned as complex numbers, the first half of the pairs by the patch's
  column + 1, the second by its row + 1 (``rope_theta`` over a quarter-head of frequencies);
  the class token unturned.
* ``layernorm_post``, the class token dropped, then the adapter: pixel shuffle (each
  ``1/r x 1/r`` block of patches, ``r = pixel_shuffle_ratio``, into one token of ``hidden / r^2``
  features, in transformers' order) and ``gelu(fc2(gelu(fc1(x))))`` (no biases).
* ``multi_modal_projector.linear_1`` (no bias) to the text width.

A tile gives ``features_per_image()`` (``(S / patch * r)^2``) tokens; the processor writes that
many ``<|patch|>`` tokens (``image_token_index``) per tile, in the tiles' order, between tile
separators; the features replace them in order (``image_text``). The language model is the
zoo's Llama 4 text decoder (``llama4_text``). The serving engine and ``redco zoo run sft``
refuse this model (``unserved``, ``untrained``) before compiling: neither tiles images yet.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from redco import remat
from redco_zoo_models import layer_scan
from redco_zoo_models.attention import attend
from redco_zoo_models.decoder import DecoderLM
from redco_zoo_models.image_text import ImageTextModel
from redco_zoo_models.layers import ACTIVATIONS
from redco_zoo_models.llama4_vision_config import Llama4ImageConfig, Llama4TowerConfig
from redco_zoo_models.rope import pairs_as_halves, rotate

EPS = 1e-5  # (transformers' nn.LayerNorm default: the config's norm_eps is not read there)


def vision_angles(cfg: Llama4TowerConfig) -> np.ndarray:
    """(patches + 1, head_dim / 2): each pair's angle, x then y, the class token's zero."""
    side, head = cfg.patches_per_side(), cfg.hidden_size // cfg.num_attention_heads
    quarter = head // 4
    freqs = cfg.rope_theta ** (-np.arange(0, head // 2, 2)[:quarter] / (head // 2))
    place = np.arange(side * side)
    angles = np.concatenate([(place % side + 1)[:, None] * freqs,
                             (place // side + 1)[:, None] * freqs], -1)
    return np.concatenate([angles, np.zeros((1, 2 * quarter))]).astype(np.float32)


def pixel_shuffle(x, ratio: float):
    """(B, side^2, C) -> (B, (side r)^2, C / r^2), as transformers' ``pixel_shuffle``."""
    b, n, c = x.shape
    side, k = round(n ** 0.5), round(1 / ratio)
    x = x.reshape(b, side, side // k, c * k).transpose(0, 2, 1, 3)
    x = x.reshape(b, side // k, side // k, c * k * k).transpose(0, 2, 1, 3)
    return x.reshape(b, -1, c * k * k)


class Attention(nnx.Module):
    def __init__(self, cfg: Llama4TowerConfig, rngs: nnx.Rngs):
        linear = lambda: nnx.Linear(cfg.hidden_size, cfg.hidden_size, rngs=rngs)  # noqa: E731
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (linear() for _ in range(4))
        self.n_heads = cfg.num_attention_heads

    def __call__(self, x, angles):
        q, k, v = (p(x).reshape(*x.shape[:2], self.n_heads, -1)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = (rotate(pairs_as_halves(t), angles[None]) for t in (q, k))
        return self.o_proj(attend(q, k, v).reshape(x.shape))


class MLP(nnx.Module):
    def __init__(self, n_in: int, n_mid: int, n_out: int, bias: bool, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(n_in, n_mid, use_bias=bias, rngs=rngs)
        self.fc2 = nnx.Linear(n_mid, n_out, use_bias=bias, rngs=rngs)


class Layer(nnx.Module):
    def __init__(self, cfg: Llama4TowerConfig, rngs: nnx.Rngs):
        h = cfg.hidden_size
        self.input_layernorm = nnx.LayerNorm(h, epsilon=EPS, rngs=rngs)
        self.post_attention_layernorm = nnx.LayerNorm(h, epsilon=EPS, rngs=rngs)
        self.self_attn = Attention(cfg, rngs)
        self.mlp = MLP(h, cfg.intermediate_size, h, True, rngs)

    @remat.layer
    def __call__(self, x, angles):
        x = x + self.self_attn(self.input_layernorm(x), angles)
        h = self.post_attention_layernorm(x)
        return x + self.mlp.fc2(ACTIVATIONS["gelu"](self.mlp.fc1(h)))


class Encoder(nnx.Module):
    def __init__(self, cfg: Llama4TowerConfig, rngs: nnx.Rngs):
        self.layers = nnx.List([Layer(cfg, rngs) for _ in range(cfg.num_hidden_layers)])
        self.runs = None  # stacked by ``stack_blocks``

    def stack_blocks(self) -> None:
        """The layers stored stacked, run under a scan (``layer_scan``; ``scan_layers``)."""
        self.layers, self.runs = layer_scan.stacked(list(self.layers))


class Llama4VisionModel(nnx.Module):
    """``__call__(pixel_values)`` (tiles, 3, S, S): the adapter's tokens (tiles, n, out)."""

    def __init__(self, cfg: Llama4TowerConfig, rngs: nnx.Rngs):
        self.cfg, h, n = cfg, cfg.hidden_size, cfg.patches_per_side() ** 2 + 1
        self.patch_embedding = nnx.Dict(linear=nnx.Linear(
            cfg.num_channels * cfg.patch_size ** 2, h, use_bias=False, rngs=rngs))
        self.class_embedding = nnx.Param(nnx.initializers.normal(h ** -0.5)(rngs.params(), (h,)))
        self.positional_embedding_vlm = nnx.Param(nnx.initializers.normal(h ** -0.5)(
            rngs.params(), (n, h)))
        self.layernorm_pre = nnx.LayerNorm(h, epsilon=EPS, rngs=rngs)
        self.layernorm_post = nnx.LayerNorm(h, epsilon=EPS, rngs=rngs)
        self.model = Encoder(cfg, rngs)
        self.vision_adapter = nnx.Dict(mlp=MLP(cfg.intermediate_size, cfg.projector_input_dim,
                                               cfg.projector_output_dim, False, rngs))

    def patches(self, pixel_values):
        """(tiles, patches, C p^2): ``Unfold``'s order (channel, then row, then column)."""
        check_tiles(pixel_values, self.cfg)
        b, c, s, p = *pixel_values.shape[:3], self.cfg.patch_size
        x = pixel_values.reshape(b, c, s // p, p, s // p, p).transpose(0, 2, 4, 1, 3, 5)
        return x.reshape(b, (s // p) ** 2, c * p * p)

    def __call__(self, pixel_values):
        linear = self.patch_embedding["linear"]  # (pixels in the params' dtype: bf16 is bf16)
        x = linear(self.patches(pixel_values).astype(linear.kernel[...].dtype))
        cls = jnp.broadcast_to(self.class_embedding[...].astype(x.dtype), (len(x), 1, x.shape[-1]))
        x = jnp.concatenate([x, cls], 1) + self.positional_embedding_vlm[...].astype(x.dtype)
        x = self.layernorm_pre(x)
        angles = jnp.asarray(vision_angles(self.cfg))
        x, _ = layer_scan.blocks(self.model.layers, self.model.runs,
                                 lambda layer, h: layer(h, angles), x)
        x = pixel_shuffle(self.layernorm_post(x)[:, :-1], self.cfg.pixel_shuffle_ratio)
        mlp, gelu = self.vision_adapter["mlp"], ACTIVATIONS["gelu"]
        return gelu(mlp.fc2(gelu(mlp.fc1(x))))


def check_tiles(pixel_values, cfg: Llama4TowerConfig) -> None:
    """Refuse pixels that are not tiles of the tower's size, before anything runs."""
    s = cfg.image_size
    if pixel_values.ndim != 4 or pixel_values.shape[1:] != (cfg.num_channels, s, s):
        raise ValueError(f"pixel_values of shape {pixel_values.shape}: Llama 4's tower reads "
                         f"tiles (tiles, {cfg.num_channels}, {s}, {s}); preprocess images with "
                         "the model's Llama4ImageProcessor.")


class Llama4ForConditionalGeneration(ImageTextModel):
    """``__call__(input_ids, attention_mask, pixel_values)``: logits (B, T, vocab)."""
    config_class = Llama4ImageConfig

    def __init__(self, cfg: Llama4ImageConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.vision_model = Llama4VisionModel(cfg.vision, rngs)
        self.multi_modal_projector = nnx.Dict(linear_1=nnx.Linear(
            cfg.vision.vision_output_dim, cfg.text.hidden_size, use_bias=False, rngs=rngs))
        self.language_model = DecoderLM(cfg.text, rngs)
        self.stack_tower(self.vision_model.model)

    def encode(self, pixel_values):
        """Each tile's projected features: (tiles, features_per_image, text hidden)."""
        return self.multi_modal_projector["linear_1"](self.vision_model(pixel_values))

    def unserved(self) -> str | None:
        return ("Llama 4 with images: the serving engine does not cut images into Llama 4's "
                "tiles yet; generate() with encoder_inputs={'pixel_values': tiles} instead.")

    def untrained(self) -> str | None:
        return ("Llama 4 with images: the SFT pipeline's collate does not cut images into "
                "Llama 4's tiles (Llama4ImageProcessor's grid and global tile) yet; fine-tune "
                "LLaVA, Gemma 3 or Qwen2.5-VL there, or this model through your own loop.")
