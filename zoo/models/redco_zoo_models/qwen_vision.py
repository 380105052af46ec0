"""Qwen2.5-VL's vision tower (transformers' ``Qwen2_5_VisionTransformerPretrainedModel``) in
Flax NNX: images of any size, cut into patches by the processor.

The image processor resizes each image to a multiple of ``patch_size * spatial_merge_size``,
repeats it ``temporal_patch_size`` times (a still image is a two-frame clip) and gives every
patch flattened, ``pixel_values`` (patches, channels * temporal * patch * patch), the patches
of all images one after another with their grids in ``image_grid_thw`` (images, 3: frames,
rows, columns of patches). The patches come in ``spatial_merge_size`` x ``spatial_merge_size``
blocks (2 x 2: four consecutive patches are one block).

* Patch embedding: transformers' strided Conv3d over one patch is a linear map of the flattened
  patch (``patch_embed.proj``, no bias; the checkpoint's 5-D kernel is reshaped on import).
* 2-D rotary positions: each head's first half of pairs turns by the patch's row, the second
  half by its column, at ``theta ** (-4i / head_dim)`` (the same frequencies for both).
* Blocks: RMSNorm (eps 1e-6), attention with a fused ``qkv`` (biases), a gated MLP with
  biases. The blocks of ``fullatt_block_indexes`` attend within each frame; the others within
  windows of ``window_size`` pixels a side (``window_size / patch_size / spatial_merge_size``
  merge blocks; the last window of a row or column is cut short by the image's edge).
  transformers reorders the patches window by window and runs each window alone; attention
  does not depend on the order of its keys, so here each patch attends to the patches with
  its window id (or frame id) in place, and no reordering is needed back.
* Merger: RMSNorm, each block's 4 patches concatenated, ``fc2(gelu(fc1(x)))`` (transformers'
  ``mlp.0``/``mlp.2``) to the language model's width: one image token per block.

The window and frame ids and the positions come from ``image_grid_thw`` on the host
(``patch_layout``, numpy): a jitted step takes them as arrays.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from redco_zoo_models import layer_scan
from redco_zoo_models.layers import ACTIVATIONS, GatedMLP, RMSNorm
from redco_zoo_models.rope import rotate

READS = {"depth": 32, "hidden_size": 3584, "hidden_act": "silu", "intermediate_size": 3420,
         "num_heads": 16, "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2,
         "temporal_patch_size": 2, "tokens_per_second": 4, "window_size": 112,
         "out_hidden_size": 3584, "fullatt_block_indexes": (7, 15, 23, 31),
         "initializer_range": 0.02}
METADATA = {"model_type", "dtype", "torch_dtype", "architectures", "transformers_version",
            "rope_parameters"}
EPS = 1e-6  # (transformers' tower norms: fixed, not in the config)


@dataclasses.dataclass(frozen=True)
class QwenVisionConfig:
    depth: int = 32
    hidden_size: int = 3584
    hidden_act: str = "silu"
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    tokens_per_second: int = 4  # (videos' temporal positions: read and kept, videos not built)
    window_size: int = 112
    out_hidden_size: int = 3584
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    initializer_range: float = 0.02
    rope_theta: float = 10000.0

    def __post_init__(self):
        head_dim, unit = self.hidden_size // self.num_heads, self.patch_size * \
            self.spatial_merge_size
        if head_dim % 4 or head_dim * self.num_heads != self.hidden_size:
            raise ValueError(f"vision hidden_size {self.hidden_size} over {self.num_heads} heads: "
                             "each head's size must be a multiple of 4 (2-D rotary pairs).")
        if self.window_size % unit:
            raise ValueError(f"vision window_size {self.window_size} must be a multiple of "
                             f"patch_size x spatial_merge_size = {unit}.")
        if any(not 0 <= i < self.depth for i in self.fullatt_block_indexes):
            raise ValueError(f"fullatt_block_indexes {list(self.fullatt_block_indexes)} must "
                             f"be blocks of the tower's {self.depth}.")

    def patch_features(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @classmethod
    def from_hf(cls, config: dict) -> "QwenVisionConfig":
        """From a ``qwen2_5_vl`` config's ``vision_config``; a key it does not read is refused."""
        if unknown := sorted(set(config) - set(READS) - METADATA):
            raise ValueError(f"vision_config has keys the zoo's Qwen2.5-VL tower does not read: "
                             f"{unknown}.")
        rope = config.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision_config: rope_type {rope['rope_type']!r}; the tower reads "
                             "'axial' (2-D rotary).")
        kwargs = {k: config.get(k, d) for k, d in READS.items()}
        kwargs["fullatt_block_indexes"] = tuple(kwargs["fullatt_block_indexes"])
        return cls(**kwargs, rope_theta=float(rope.get("rope_theta", 10000.0)))

    def to_hf(self) -> dict:
        out = {k: getattr(self, k) for k in READS}
        return {**out, "fullatt_block_indexes": list(self.fullatt_block_indexes),
                "model_type": "qwen2_5_vl_vision",
                "rope_parameters": {"rope_type": "axial", "rope_theta": self.rope_theta}}


def patch_layout(grid_thw, cfg) -> dict[str, np.ndarray]:
    """Per patch, in the processor's order: ``rows_cols`` (patches, 2), its row and column in
    its image; ``frame`` and ``window``, ids of the frame and window it attends within (a
    tower without windows, Qwen3-VL's: windows as large as the image)."""
    m, layout, frames, windows = cfg.spatial_merge_size, [], 0, 0
    per_window = getattr(cfg, "window_size", 0) // cfg.patch_size // m or \
        int(np.max(grid_thw)) // m  # (merge blocks a side)
    for t, h, w in np.asarray(grid_thw).tolist():
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        blocks = lambda a: a.reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3).ravel()  # noqa: E731
        frame, row, col = np.meshgrid(np.arange(t), np.arange(h // m), np.arange(w // m),
                                      indexing="ij")
        across, down = -(-(w // m) // per_window), -(-(h // m) // per_window)
        window = (frame * down + row // per_window) * across + col // per_window
        layout.append((np.tile(np.stack([blocks(rows), blocks(cols)], -1), (t, 1)),
                       frames + np.repeat(np.arange(t), h * w),
                       windows + np.repeat(window.ravel(), m * m)))
        frames, windows = frames + t, windows + t * down * across
    return {k: np.concatenate(v).astype(np.int32)
            for k, v in zip(("rows_cols", "frame", "window"), zip(*layout))}


def rotary_angles(rows_cols, cfg):
    """(patches, head_dim / 2): rows turn the first half of the pairs, columns the rest."""
    quarter = cfg.hidden_size // cfg.num_heads // 4
    inv_freq = cfg.rope_theta ** (-jnp.arange(quarter, dtype=jnp.float32) / quarter)
    turns = jnp.asarray(rows_cols)[..., None].astype(jnp.float32) * inv_freq
    return turns.reshape(len(rows_cols), -1)  # (patches, 2 x quarter)


class VisionAttention(nnx.Module):
    def __init__(self, cfg: QwenVisionConfig, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
        self.proj = nnx.Linear(d, d, rngs=rngs)
        self.heads = cfg.num_heads

    def __call__(self, x, angles, same):
        """``x`` (patches, hidden); ``angles`` (patches, head_dim / 2); ``same`` (patches,
        patches): which keys each patch sees."""
        n = x.shape[0]  # (split on the fused output's last dim, not a leading axis of 3:
        # tensor parallelism then keeps each of q, k, v split by heads; redco.dataflow)
        q, k, v = (t.reshape(1, n, self.heads, -1) for t in jnp.split(self.qkv(x), 3, -1))
        q, k = rotate(q, angles[None]), rotate(k, angles[None])
        out = jax.nn.dot_product_attention(q, k, v, mask=same[None, None])
        return self.proj(out.reshape(n, -1))


class VisionBlock(nnx.Module):
    """``full``: it attends within its frame, else within its window (a kind of its own when
    the blocks are stacked: ``layer_scan.segments``)."""

    def __init__(self, cfg: QwenVisionConfig, rngs: nnx.Rngs, full: bool = False):
        self.full = full
        self.norm1 = RMSNorm(cfg.hidden_size, EPS)
        self.norm2 = RMSNorm(cfg.hidden_size, EPS)
        self.attn = VisionAttention(cfg, rngs)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, rngs,
                            bias=True)

    def __call__(self, x, angles, same: dict):
        """``same``: the ``frame`` and ``window`` masks; the block reads its own."""
        x = x + self.attn(self.norm1(x), angles, same["frame" if self.full else "window"])
        return x + self.mlp(self.norm2(x))


class PatchMerger(nnx.Module):
    """Each block of ``spatial_merge_size ** 2`` patches to one token of ``out_hidden_size``."""

    def __init__(self, cfg: QwenVisionConfig, rngs: nnx.Rngs):
        wide = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.ln_q = RMSNorm(cfg.hidden_size, EPS)
        self.fc1 = nnx.Linear(wide, wide, rngs=rngs)  # (transformers' mlp.0)
        self.fc2 = nnx.Linear(wide, cfg.out_hidden_size, rngs=rngs)  # (mlp.2)

    def __call__(self, x):
        x = self.ln_q(x).reshape(-1, self.fc1.in_features)
        return self.fc2(ACTIVATIONS["gelu"](self.fc1(x)))


class QwenVisionModel(nnx.Module):
    """``__call__(pixel_values, layout)``: ``((patches / merge blocks, out_hidden_size), [])``."""
    config_class = QwenVisionConfig

    def __init__(self, cfg: QwenVisionConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.patch_embed = nnx.Dict(proj=nnx.Linear(cfg.patch_features(), cfg.hidden_size,
                                                    use_bias=False, rngs=rngs))
        self.blocks = nnx.List([VisionBlock(cfg, rngs, i in cfg.fullatt_block_indexes)
                                for i in range(cfg.depth)])
        self.runs = None  # stacked by ``stack_blocks``
        self.merger = PatchMerger(cfg, rngs)

    def stack_blocks(self) -> None:
        """The blocks stored stacked, run under a scan (``layer_scan``; ``scan_layers``)."""
        self.blocks, self.runs = layer_scan.stacked(list(self.blocks))

    def __call__(self, pixel_values, layout: dict):
        """``(features, [])``: no DeepStack features (Qwen3-VL's tower has them)."""
        proj = self.patch_embed["proj"]  # (pixels in the params' dtype: bf16 compute is bf16)
        x = proj(pixel_values.astype(proj.kernel[...].dtype))
        angles = rotary_angles(layout["rows_cols"], self.cfg)
        same = {key: jnp.asarray(layout[key])[:, None] == jnp.asarray(layout[key])[None, :]
                for key in ("frame", "window")}
        x, _ = layer_scan.blocks(self.blocks, self.runs,
                                 lambda block, h: block(h, angles, same), x)
        return self.merger(x), []
