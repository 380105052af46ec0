"""The image-text presets (``redco_zoo_models.presets_vlm``: Qwen2.5-VL, Qwen3-VL, Gemma 3 and
Llama 4 Scout with images) built abstractly for ``redco plan`` and ``redco rules``: the whole
model, tower and projector included, its train step on rows that each hold one image.

A row is ``seq_len`` tokens, the image's tokens (``IMAGES[name].tokens``: 256 for Qwen2.5-VL's
448 x 448 and Gemma 3's 896 x 896, 196 for Qwen3-VL's 448 x 448, 144 for Llama 4's one
336 x 336 tile) at its start and text after; the loss is the model's own next-token loss
(``labels=``: the chunked loss of ``DecoderLM``) over the row. Qwen's towers read each row's
image alone (``jax.vmap`` over the rows, its patch layout and M-RoPE positions made once on the
host from the one grid), as one image's patches attend only within it; Gemma 3 reads
``pixel_values`` (rows, 1, 3, 896, 896), Llama 4 (rows, 1, 3, 336, 336).
LoRA (``lora(rank)``) puts the zoo's adapters on the language model's projections only, the
tower and projector frozen, as ``redco zoo run sft`` does by default. With ``scan_layers`` the
language model's layers and the tower's blocks are stored stacked and scanned
(``redco_zoo_models.layer_scan``: one traced block, e.g. ``visual/blocks/0:27/...``).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from redco_planner.models import LoraModel, Model, zoo_models


def vlm_names() -> list[str]:
    """The image-text presets, or none where the zoo is not installed."""
    try:
        from redco_zoo_models.presets_vlm import VLM_PRESETS
    except ImportError:
        return []
    return list(VLM_PRESETS)


def zoo_vlm(name: str, seq_len: int = 128, scan_layers: bool | None = None) -> Model:
    """The image-text preset ``name`` built with ``nnx.eval_shape`` (nothing allocated)."""
    from flax import nnx
    zoo = zoo_models()
    from redco_zoo_models.hf import class_of
    from redco_zoo_models.presets_vlm import IMAGES, vlm_preset
    config = vlm_preset(name)
    model_class = class_of(config, name, images=True)  # (Llama 4's: not its language model)
    cfg = model_class.config_class.from_hf(config)
    cfg = dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, scan_layers=scan_layers))
    image = IMAGES[name]
    if seq_len <= image.tokens + 2:
        raise ValueError(f"--seq_len {seq_len}: a row of {name} holds one image's "
                         f"{image.tokens} tokens; give more.")
    build = lambda: model_class(cfg, rngs=nnx.Rngs(0))  # noqa: E731
    loss_of = qwen_loss if hasattr(cfg, "LAYOUT") else gemma_loss
    graphdef, params = nnx.split(nnx.eval_shape(build), nnx.Param)

    def with_lora(rank: int, targets: str | None = None) -> LoraModel:
        only_text = f"^language_model/.*?(?:{targets or zoo.lora.DEFAULT_TARGETS})"
        lora_def, lora_params = nnx.split(nnx.eval_shape(
            lambda: zoo.add_lora(build(), rank, targets=only_text)), nnx.Param)
        return LoraModel(lora_params, loss_of(lora_def, cfg, image, seq_len),
                         "redco_zoo_models.add_lora on the language model (tower frozen)")
    loss = loss_of(graphdef, cfg, image, seq_len)
    batch = row_batch(cfg, image, seq_len)
    return Model(params=params, trace_fn=lambda p: loss(p, zeros(batch(1))), loss_fn=loss,
                 batch=batch, lora=with_lora, scanned=cfg.text.scan_layers)


def zeros(batch: dict) -> dict:
    return {k: jnp.zeros(v.shape, v.dtype) for k, v in batch.items()}


def row_batch(cfg, image, seq_len: int):
    """``rows -> `` the abstract batch: ``input_ids`` (rows, seq_len + 1) and each row's image."""
    if hasattr(cfg, "LAYOUT"):
        pixels = (image.patches, cfg.vision.patch_features())
    else:
        pixels = (1, cfg.vision.num_channels, image.size, image.size)
    return lambda rows: {
        "input_ids": jax.ShapeDtypeStruct((rows, seq_len + 1), jnp.int32),
        "pixel_values": jax.ShapeDtypeStruct((rows, *pixels), jnp.float32)}


def gemma_loss(graphdef, cfg, image, seq_len: int):
    """The model's loss on ``input_ids`` and ``pixel_values`` (rows, 1, 3, H, W): Gemma 3's,
    Llama 4's (one tile a row)."""
    from flax import nnx

    def loss(params, batch):
        ids = batch["input_ids"]
        return nnx.merge(graphdef, params)(ids[:, :-1], pixel_values=batch["pixel_values"],
                                           labels=ids[:, 1:])
    return loss


def qwen_loss(graphdef, cfg, image, seq_len: int):
    """Qwen-VL's loss: each row's patches (rows, patches, features) through the tower alone,
    the features (and DeepStack's) placed at the row's image tokens, M-RoPE positions of a row
    with the image first."""
    from flax import nnx

    from redco_zoo_models.mrope import rope_index
    side = int(round(image.patches ** 0.5))
    grid = np.array([[1, side, side]])
    layout = {k: jnp.asarray(v) for k, v in cfg.LAYOUT(grid, cfg.vision).items()}
    template = np.zeros((1, seq_len), np.int32)
    template[0, 0], template[0, image.tokens + 1] = (cfg.vision_start_token_id,
                                                     cfg.vision_end_token_id)
    template[0, 1:image.tokens + 1] = cfg.image_token_id
    positions = jnp.asarray(rope_index(template, None, grid, cfg.image_token_id,
                                       cfg.vision.spatial_merge_size)[0])

    def loss(params, batch):
        model = nnx.merge(graphdef, params)
        ids = batch["input_ids"]
        features, deep = jax.vmap(lambda p: model.visual(p, layout))(batch["pixel_values"])
        text, labels = ids[:, :-1], ids[:, 1:]
        embeds = model.place(text, features, model.language_model.model.embed(text), True)
        blank = jnp.zeros((*text.shape, cfg.text.hidden_size), features.dtype)
        deepstack = [model.place(text, d, blank, True) for d in deep] or None
        return model.language_model(
            text, labels=labels, inputs_embeds=embeds, deepstack=deepstack,
            positions=jnp.broadcast_to(positions, (3, *text.shape)))
    return loss
