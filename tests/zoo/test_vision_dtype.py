"""The image towers compute in the step's compute dtype: under ``Trainer(compute_dtype=bf16)``
the params arrive cast (``redco.train_step.cast_floats``) but ``pixel_values`` arrive in fp32
from the image processor, and a tower whose first matmul took them as they are ran in fp32
throughout (promotion), holding twice the activations (BENCHMARKS section 44's Qwen rows). Each
tower's features must come out in bf16, as transformers runs ``pixel_values.to(model.dtype)``."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from redco.train_step import cast_floats
from redco_zoo_models.clip_vision import CLIPVisionConfig, CLIPVisionModel
from redco_zoo_models.gemma4_vision import Gemma4VisionModel
from redco_zoo_models.gemma4_vision_config import Gemma4VisionTowerConfig
from redco_zoo_models.llama4_vision import Llama4VisionModel
from redco_zoo_models.llama4_vision_config import Llama4TowerConfig
from redco_zoo_models.qwen3_vision import Qwen3VisionConfig, Qwen3VisionModel, interpolation
from redco_zoo_models.qwen_vision import QwenVisionConfig, QwenVisionModel, patch_layout
from redco_zoo_models.siglip_vision import SiglipVisionConfig, SiglipVisionModel

GRID = np.array([[1, 4, 4]])  # one image of 4 x 4 patches
SMALL = dict(hidden_size=32, intermediate_size=16, patch_size=4)


def qwen2_5():
    cfg = QwenVisionConfig(depth=2, num_heads=2, window_size=8, out_hidden_size=16,
                           fullatt_block_indexes=(1,), **SMALL)
    return QwenVisionModel(cfg, nnx.Rngs(0)), (np.ones((16, cfg.patch_features()), np.float32),
                                               patch_layout(GRID, cfg))


def qwen3():
    cfg = Qwen3VisionConfig(depth=2, num_heads=2, out_hidden_size=16, num_position_embeddings=16,
                            deepstack_visual_indexes=(0,), **SMALL)
    layout = {**patch_layout(GRID, cfg), **interpolation(GRID, cfg)}
    return Qwen3VisionModel(cfg, nnx.Rngs(0)), (np.ones((16, cfg.patch_features()), np.float32),
                                                layout)


def gemma4():
    cfg = Gemma4VisionTowerConfig(num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=2, head_dim=16, pooling_kernel_size=2,
                                  position_embedding_size=8, **SMALL)
    places = np.stack(np.meshgrid(np.arange(4), np.arange(4), indexing="ij"), -1).reshape(1, 16, 2)
    return Gemma4VisionModel(cfg, nnx.Rngs(0)), (np.ones((1, 16, 48), np.float32), places)


def llama4():
    cfg = Llama4TowerConfig(hidden_size=32, intermediate_size=128, num_hidden_layers=1,
                            num_attention_heads=2, image_size=16, patch_size=4,
                            projector_input_dim=16, projector_output_dim=16, vision_output_dim=16)
    return Llama4VisionModel(cfg, nnx.Rngs(0)), (np.ones((2, 3, 16, 16), np.float32),)


def clip(config=CLIPVisionConfig, model=CLIPVisionModel):
    cfg = config(num_hidden_layers=1, num_attention_heads=2, image_size=8, **SMALL)
    return model(cfg, nnx.Rngs(0)), (np.ones((1, 3, 8, 8), np.float32), 1)


@pytest.mark.parametrize("tower", [qwen2_5, qwen3, gemma4, llama4, clip,
                                   lambda: clip(SiglipVisionConfig, SiglipVisionModel)],
                         ids=["qwen2.5-vl", "qwen3-vl", "gemma4", "llama4", "clip", "siglip"])
def test_a_tower_under_bf16_params_computes_in_bf16_from_fp32_pixels(tower):
    model, inputs = tower()
    graphdef, params = nnx.split(model)

    def features(params):  # (traced abstractly: dtypes need no compile)
        model = nnx.merge(graphdef, params)
        out = model.hidden_states(*inputs) if hasattr(model, "hidden_states") else model(*inputs)
        return out[-1] if isinstance(out, list) else out[0] if isinstance(out, tuple) else out
    features = jax.eval_shape(features, cast_floats(params, jnp.bfloat16))
    assert features.dtype == jnp.bfloat16, f"the tower computed in {features.dtype}"
