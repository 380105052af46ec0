"""Published image-text models as ``config.json`` contents, by name, with the image each row
of a planned batch holds (``redco plan --model qwen2.5-vl-7b``; BENCHMARKS.md section 44).

The numbers are the hub's config.json values of the instruct checkpoints: Qwen/Qwen2.5-VL-7B-
Instruct, Qwen/Qwen3-VL-8B-Instruct, google/gemma-3-12b-it and google/gemma-3-27b-it (their
``text_config`` the same shapes as the text presets ``gemma-3-12b`` and ``gemma-3-27b``, their
``vision_config`` SigLIP-So400m at 896 x 896), meta-llama/Llama-4-Scout-17B-16E-Instruct
(its ``text_config`` the text preset ``llama-4-scout``'s, ``presets_2026``; its tower
``redco_zoo_models.llama4_vision``'s). ``IMAGES[name]``: the one image per row a plan assumes,
and the image tokens it becomes.
"""
from __future__ import annotations

import copy
from typing import Any, NamedTuple

from redco_zoo_models import presets


class RowImage(NamedTuple):
    """One image per planned row: ``size`` pixels a side, ``patches`` the tower reads, and
    ``tokens`` the image tokens it takes in the row."""
    size: int
    patches: int
    tokens: int


QWEN_IDS = {"image_token_id": 151655, "video_token_id": 151656,
            "vision_start_token_id": 151652, "vision_end_token_id": 151653}


def _qwen2_5_vl_7b() -> dict[str, Any]:
    """Qwen2.5-VL-7B: a Qwen2 decoder of 28 layers of 3,584 (28 query, 4 KV heads, biases);
    a 32-block tower of 1,280 (16 heads, windows of 112 pixels, full attention in blocks
    7, 15, 23, 31), 14-pixel patches merged 2 x 2."""
    text = {"model_type": "qwen2_5_vl_text", "vocab_size": 152064, "hidden_size": 3584,
            "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
            "num_key_value_heads": 4, "hidden_act": "silu", "rms_norm_eps": 1e-6,
            "max_position_embeddings": 128000, "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                "mrope_section": [16, 24, 24]},
            "bos_token_id": 151643, "eos_token_id": 151645}
    vision = {"depth": 32, "hidden_size": 1280, "hidden_act": "silu", "intermediate_size": 3420,
              "num_heads": 16, "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2,
              "temporal_patch_size": 2, "tokens_per_second": 2, "window_size": 112,
              "out_hidden_size": 3584, "fullatt_block_indexes": [7, 15, 23, 31]}
    return {"model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"],
            "text_config": text, "vision_config": vision, "tie_word_embeddings": False,
            **QWEN_IDS}


def _qwen3_vl_8b() -> dict[str, Any]:
    """Qwen3-VL-8B: a Qwen3 decoder of 36 layers of 4,096 (32 query, 8 KV heads of 128,
    interleaved M-RoPE); a 27-block tower of 1,152 (16 heads), 16-pixel patches merged 2 x 2,
    DeepStack features from blocks 8, 16 and 24."""
    text = {"model_type": "qwen3_vl_text", "vocab_size": 151936, "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
            "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0,
                                "mrope_section": [24, 20, 20], "mrope_interleaved": True},
            "bos_token_id": 151643, "eos_token_id": 151645}
    vision = {"depth": 27, "hidden_size": 1152, "hidden_act": "gelu_pytorch_tanh",
              "intermediate_size": 4304, "num_heads": 16, "in_channels": 3, "patch_size": 16,
              "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 4096,
              "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24]}
    return {"model_type": "qwen3_vl", "architectures": ["Qwen3VLForConditionalGeneration"],
            "text_config": text, "vision_config": vision, "tie_word_embeddings": False,
            **QWEN_IDS}


def _gemma3_vision(text_preset: str) -> dict[str, Any]:
    """Gemma 3 with images: the text preset's decoder, SigLIP-So400m (27 layers of 1,152,
    16 heads, 14-pixel patches of a 896 x 896 image) pooled to 256 tokens an image."""
    text = {k: v for k, v in presets.preset(text_preset).items() if k != "architectures"}
    vision = {"model_type": "siglip_vision_model", "hidden_size": 1152,
              "intermediate_size": 4304, "num_hidden_layers": 27, "num_attention_heads": 16,
              "image_size": 896, "patch_size": 14, "hidden_act": "gelu_pytorch_tanh",
              "layer_norm_eps": 1e-6, "vision_use_head": False}
    return {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
            "text_config": text, "vision_config": vision, "mm_tokens_per_image": 256,
            "boi_token_index": 255999, "eoi_token_index": 256000,
            "image_token_index": 262144, "tie_word_embeddings": True}


def _llama4_scout_vision() -> dict[str, Any]:
    """Llama-4-Scout-17B-16E-Instruct: the text preset ``llama-4-scout``'s decoder; a tower of
    34 layers of 1,408 (16 heads, MLP 5,632) on 336 x 336 tiles of 14-pixel patches, pixel-
    shuffled (ratio 0.5) into 144 tokens of 5,632 features, an adapter to 4,096 and a
    projector to 5,120 (``redco_zoo_models.llama4_vision``)."""
    text = {k: v for k, v in presets.preset("llama-4-scout").items() if k != "architectures"}
    vision = {"model_type": "llama4_vision_model", "hidden_size": 1408,
              "intermediate_size": 5632, "num_hidden_layers": 34, "num_attention_heads": 16,
              "num_channels": 3, "image_size": 336, "patch_size": 14,
              "pixel_shuffle_ratio": 0.5, "projector_input_dim": 4096,
              "projector_output_dim": 4096, "vision_output_dim": 4096, "rope_theta": 10000,
              "hidden_act": "gelu", "norm_eps": 1e-5, "multi_modal_projector_bias": False,
              "vision_feature_layer": -1, "vision_feature_select_strategy": "default"}
    return {"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"],
            "text_config": text, "vision_config": vision, "boi_token_index": 200080,
            "eoi_token_index": 200081, "image_token_index": 200092,
            "tie_word_embeddings": False}


VLM_PRESETS: dict[str, dict[str, Any]] = {
    "qwen2.5-vl-7b": _qwen2_5_vl_7b(),
    "qwen3-vl-8b": _qwen3_vl_8b(),
    "gemma-3-12b-vision": _gemma3_vision("gemma-3-12b"),
    "gemma-3-27b-vision": _gemma3_vision("gemma-3-27b"),
    "llama-4-scout-vision": _llama4_scout_vision(),
}

# one image a row: Qwen's at 448 x 448 (Qwen2.5-VL: 32 x 32 patches of 14; Qwen3-VL: 28 x 28
# of 16), 2 x 2 merged; Gemma 3's at its fixed 896 x 896 (64 x 64 patches of 14, pooled to 256);
# Llama 4's one 336 x 336 tile (an image no larger: no grid, no global tile; 24 x 24 patches of
# 14, pixel-shuffled to 144)
IMAGES: dict[str, RowImage] = {
    "qwen2.5-vl-7b": RowImage(448, 1024, 256), "qwen3-vl-8b": RowImage(448, 784, 196),
    "gemma-3-12b-vision": RowImage(896, 4096, 256), "gemma-3-27b-vision": RowImage(896, 4096, 256),
    "llama-4-scout-vision": RowImage(336, 576, 144),
}

# the hub's parameter counts (safetensors, tower and projector included)
PUBLISHED_PARAMS: dict[str, float] = {"qwen2.5-vl-7b": 8.29e9, "qwen3-vl-8b": 8.77e9,
                                      "gemma-3-12b-vision": 12.2e9,
                                      "gemma-3-27b-vision": 27.4e9,
                                      "llama-4-scout-vision": 109e9}  # (its card: 109B)


def vlm_preset(name: str) -> dict[str, Any]:
    """A copy of ``VLM_PRESETS[name]``; an unknown name is refused with the list of names."""
    if name not in VLM_PRESETS:
        raise KeyError(f"No image-text preset {name!r}: they are {', '.join(VLM_PRESETS)}.")
    return copy.deepcopy(VLM_PRESETS[name])
