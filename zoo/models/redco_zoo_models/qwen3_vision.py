"""Qwen3-VL's vision tower (transformers' ``Qwen3VLVisionModel``) in Flax NNX: Qwen2.5-VL's
patches and 2-D rotary (``redco_zoo_models.qwen_vision``) with these differences.

* The patch embedding has a bias, and a learned position table of ``num_position_embeddings``
  (a square, ``side`` a side) is added: each image's patch grid reads it bilinearly resampled
  (``align_corners``: the grid's first and last rows and columns at the table's), four taps a
  patch made on the host (``interpolation``).
* Blocks: LayerNorm (eps 1e-6) and a plain MLP (``linear_fc2(act(linear_fc1(x)))``); every
  block attends within its frame (no windows).
* Merger: LayerNorm over each patch, then the 2 x 2 block concatenated and
  ``linear_fc2(gelu(linear_fc1(x)))``. DeepStack: after each block of
  ``deepstack_visual_indexes`` a merger of its own (its LayerNorm over the concatenated block)
  makes one more feature per image token; the language model adds them to its hidden states at
  the image tokens after its first layers (``redco_zoo_models.qwen_vl``).

Qwen3.5's tower (``Qwen3_5VisionConfig``) is this one without DeepStack (no
``deepstack_visual_indexes`` in its config, none written back).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from redco_zoo_models import layer_scan
from redco_zoo_models.layers import ACTIVATIONS
from redco_zoo_models.qwen_vision import VisionAttention, patch_layout, rotary_angles

READS = {"depth": 27, "hidden_size": 1152, "hidden_act": "gelu_pytorch_tanh",
         "intermediate_size": 4304, "num_heads": 16, "in_channels": 3, "patch_size": 16,
         "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 3584,
         "num_position_embeddings": 2304, "deepstack_visual_indexes": (8, 16, 24),
         "initializer_range": 0.02}
METADATA = {"model_type", "dtype", "torch_dtype", "architectures", "transformers_version",
            "rope_parameters"}
EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class Qwen3VisionConfig:
    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    initializer_range: float = 0.02
    rope_theta: float = 10000.0

    MODEL_TYPE, DEEPSTACK = "qwen3_vl_vision", True  # (Qwen3.5's: no DeepStack, no key for it)

    def __post_init__(self):
        side = round(self.num_position_embeddings ** 0.5)
        if side * side != self.num_position_embeddings:
            raise ValueError(f"vision num_position_embeddings {self.num_position_embeddings} "
                             "must be a square (the learned position grid).")
        if any(not 0 <= i < self.depth for i in self.deepstack_visual_indexes):
            raise ValueError(f"deepstack_visual_indexes {list(self.deepstack_visual_indexes)} "
                             f"must be blocks of the tower's {self.depth}.")

    def patch_features(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @classmethod
    def from_hf(cls, config: dict) -> "Qwen3VisionConfig":
        """From a ``qwen3_vl`` config's ``vision_config``; a key it does not read is refused."""
        reads = READS if cls.DEEPSTACK else {k: d for k, d in READS.items()
                                             if k != "deepstack_visual_indexes"}
        if unknown := sorted(set(config) - set(reads) - METADATA):
            raise ValueError(f"vision_config has keys the zoo's {cls.MODEL_TYPE} tower does not "
                             f"read: {unknown}.")
        kwargs = {k: config.get(k, d) for k, d in reads.items()}
        kwargs["deepstack_visual_indexes"] = tuple(kwargs.get("deepstack_visual_indexes", ()))
        rope = config.get("rope_parameters") or {}
        return cls(**kwargs, rope_theta=float(rope.get("rope_theta", 10000.0)))

    def to_hf(self) -> dict:
        deep = {"deepstack_visual_indexes": list(self.deepstack_visual_indexes)}
        return {**{k: getattr(self, k) for k in READS}, "model_type": self.MODEL_TYPE,
                **(deep if self.DEEPSTACK else {}),
                "rope_parameters": {"rope_type": "axial", "rope_theta": self.rope_theta}}


@dataclasses.dataclass(frozen=True)
class Qwen3_5VisionConfig(Qwen3VisionConfig):
    """Qwen3.5's tower: Qwen3-VL's without DeepStack (transformers' ``Qwen3_5VisionModel``)."""
    deepstack_visual_indexes: tuple[int, ...] = ()

    MODEL_TYPE, DEEPSTACK = "qwen3_5_vision", False


class Qwen3_5MoeVisionConfig(Qwen3_5VisionConfig):
    MODEL_TYPE = "qwen3_5_moe_vision"


def axis_taps(index: np.ndarray, size: np.ndarray, side: int):
    """Bilinear taps (n, 2) and weights (n, 2) of ``index`` on an axis of ``size`` read from
    ``side`` table entries, corners aligned."""
    source = index * (side - 1) / np.maximum(size - 1, 1)
    floor = np.floor(source)
    taps = floor[:, None].astype(np.int64) + np.arange(2)
    weights = np.clip(1 - np.abs(source[:, None] - taps), 0, None)
    return np.clip(taps, 0, side - 1), weights


def interpolation(grid_thw, cfg: Qwen3VisionConfig) -> dict[str, np.ndarray]:
    """``patch_layout``'s arrays plus ``taps`` and ``tap_weights`` (patches, 4): where each
    patch reads the learned position table, and how much."""
    layout = patch_layout(grid_thw, cfg)
    grid = np.asarray(grid_thw)
    sizes = np.repeat(grid[:, 1:], np.prod(grid, -1), 0)  # (patches, 2): its image's rows, cols
    side = round(cfg.num_position_embeddings ** 0.5)
    (rows, row_w), (cols, col_w) = (axis_taps(layout["rows_cols"][:, i], sizes[:, i], side)
                                    for i in (0, 1))
    taps = (rows[:, :, None] * side + cols[:, None, :]).reshape(-1, 4)
    weights = (row_w[:, :, None] * col_w[:, None, :]).reshape(-1, 4)
    return {**layout, "taps": taps.astype(np.int32), "tap_weights": weights.astype(np.float32)}


class VisionMLP(nnx.Module):
    def __init__(self, n_in: int, n_mid: int, n_out: int, act: str, rngs: nnx.Rngs):
        self.linear_fc1 = nnx.Linear(n_in, n_mid, rngs=rngs)
        self.linear_fc2 = nnx.Linear(n_mid, n_out, rngs=rngs)
        self.act = act

    def __call__(self, x):
        return self.linear_fc2(ACTIVATIONS[self.act](self.linear_fc1(x)))


class Block(nnx.Module):
    def __init__(self, cfg: Qwen3VisionConfig, rngs: nnx.Rngs):
        norm = lambda: nnx.LayerNorm(cfg.hidden_size, epsilon=EPS, rngs=rngs)  # noqa: E731
        self.norm1, self.norm2 = norm(), norm()
        self.attn = VisionAttention(cfg, rngs)
        self.mlp = VisionMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_size,
                             cfg.hidden_act, rngs)

    def __call__(self, x, angles, same):
        x = x + self.attn(self.norm1(x), angles, same)
        return x + self.mlp(self.norm2(x))


class Merger(VisionMLP):
    """A 2 x 2 block of patches to one token; ``after``: normed after the concatenation."""

    def __init__(self, cfg: Qwen3VisionConfig, after: bool, rngs: nnx.Rngs):
        wide = cfg.hidden_size * cfg.spatial_merge_size ** 2
        super().__init__(wide, wide, cfg.out_hidden_size, "gelu", rngs)
        self.norm = nnx.LayerNorm(wide if after else cfg.hidden_size, epsilon=EPS, rngs=rngs)
        self.after, self.wide = after, wide

    def __call__(self, x):
        x = self.norm(x.reshape(-1, self.wide)) if self.after else self.norm(x)
        return super().__call__(x.reshape(-1, self.wide))


class Qwen3VisionModel(nnx.Module):
    """``__call__(pixel_values, layout)``: ``(features, [deepstack features])``, each (image
    tokens, out_hidden_size); ``layout``: ``interpolation``'s."""
    config_class = Qwen3VisionConfig

    def __init__(self, cfg: Qwen3VisionConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.patch_embed = nnx.Dict(proj=nnx.Linear(cfg.patch_features(), cfg.hidden_size,
                                                    rngs=rngs))
        self.pos_embed = nnx.Embed(cfg.num_position_embeddings, cfg.hidden_size, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.depth)])
        self.runs = None  # stacked by ``stack_blocks``
        self.merger = Merger(cfg, False, rngs)
        self.deepstack_merger_list = nnx.List([Merger(cfg, True, rngs)
                                               for _ in cfg.deepstack_visual_indexes])

    def stack_blocks(self) -> None:
        """The blocks stored stacked, run under one scan (``layer_scan``; ``scan_layers``):
        the DeepStack taps are read from its ``ys`` (``layer_scan.blocks``' ``keep``)."""
        self.blocks, self.runs = layer_scan.stacked(list(self.blocks))

    def __call__(self, pixel_values, layout: dict):
        proj = self.patch_embed["proj"]  # (pixels in the params' dtype: bf16 compute is bf16)
        x = proj(pixel_values.astype(proj.kernel[...].dtype))
        table = self.pos_embed.embedding[...]
        x = x + (table[jnp.asarray(layout["taps"])] *
                 jnp.asarray(layout["tap_weights"])[..., None]).sum(1).astype(x.dtype)
        angles = rotary_angles(layout["rows_cols"], self.cfg)
        frame = jnp.asarray(layout["frame"])
        same, taps = frame[:, None] == frame[None, :], self.cfg.deepstack_visual_indexes
        x, states = layer_scan.blocks(self.blocks, self.runs,
                                      lambda block, h: block(h, angles, same), x, bool(taps))
        return self.merger(x), [self.deepstack_merger_list[taps.index(i)](states[i])
                                for i in sorted(taps)]  # (in the blocks' order)
