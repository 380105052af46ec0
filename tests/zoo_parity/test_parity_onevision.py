"""LLaVA-OneVision (SigLIP tower + LLaVA's projector + Qwen2, anyres tiles) against transformers'
PyTorch ``LlavaOnevisionForConditionalGeneration``: inputs made by a real
``LlavaOnevisionProcessor`` (its image processor cutting PIL images drawn here into tiles, a
word-level tokenizer built here) give the same float32 logits and packed image features, the
same greedy tokens, and an exported checkpoint transformers loads back.

The images: a prompt with one 70 x 50 image (a 2 x 2 grid of tiles, padding columns cut), one
with a 20 x 100 image (1 x 3, padding rows cut), one with two images (each its base tile and a
newline); at ``anyres_max_9`` the grids are kept, at ``anyres_max_1`` shrunk (bilinear)."""
import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from parity import (
    close,
    hf_greedy,
    jiggle_ours,
    jiggle_torch,
    load_hf,
    saved,
    torch,
    torch_logits,
    transformers,
    word_tokenizer,
)
from PIL import Image

from redco_zoo_models.engine import Engine
from redco_zoo_models.generation import generate
from redco_zoo_models.hf import auto_class, from_pretrained, save_pretrained
from redco_zoo_models.onevision import LlavaOnevisionForConditionalGeneration, OnevisionConfig

WORDS = ["<unk>", "<s>", "USER:", "ASSISTANT:", "what", "is", "in", "this", "picture", "?"]
IMAGE, PAD, EOS = 60, 62, 63
PINPOINTS = [[32, 32], [32, 64], [64, 32], [64, 64], [32, 96], [96, 32]]
VISION = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=48,
              num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8,
              vision_use_head=False)
TEXT = dict(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=48,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, eos_token_id=EOS,
            pad_token_id=PAD)
PROMPTS = ["USER: <image> what is in this picture ? ASSISTANT:", "<image> picture ?",
           "<image> <image> what is this ?"]
SIZES = [[(70, 50)], [(20, 100)], [(50, 30), (20, 20)]]  # (height, width) of each prompt's


class ImageProcessor(transformers.LlavaOnevisionProcessor):
    """The real processor without its video processor (which needs torchvision)."""

    def check_argument_for_proper_class(self, name, argument):
        return None if argument is None else super().check_argument_for_proper_class(
            name, argument)


def inputs(aspect_ratio: str) -> dict:
    """The processor's arrays (left-padded) for ``PROMPTS`` with images of ``SIZES``."""
    vocab = {**{w: i for i, w in enumerate(WORDS)}, "<image>": IMAGE, "<pad>": PAD, "</s>": EOS}
    tokenizer = word_tokenizer(vocab, pad_token="<pad>", eos_token="</s>",
                               extra_special_tokens={"image_token": "<image>"})
    images = transformers.LlavaOnevisionImageProcessorPil(size={"height": 32, "width": 32},
                                                          image_grid_pinpoints=PINPOINTS)
    processor = ImageProcessor(image_processor=images, tokenizer=tokenizer, video_processor=None,
                               num_image_tokens=16, vision_feature_select_strategy="full",
                               vision_aspect_ratio=aspect_ratio)
    rng = np.random.RandomState(0)
    drawn = [[Image.fromarray((rng.rand(h, w, 3) * 255).astype(np.uint8)) for h, w in sizes]
             for sizes in SIZES]
    out = processor(images=drawn, text=PROMPTS, padding=True, return_tensors="np")
    return {k: np.asarray(v) for k, v in out.items()}


def hf_config(**changes):
    kwargs = dict(vision_config=VISION, text_config=TEXT, image_token_index=IMAGE,
                  image_grid_pinpoints=PINPOINTS)
    return transformers.LlavaOnevisionConfig(**{**kwargs, **changes})


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """transformers' tiny model (weights jiggled) and the zoo's, read from its checkpoint."""
    theirs = jiggle_torch(transformers.LlavaOnevisionForConditionalGeneration(hf_config()))
    path = saved(theirs, tmp_path_factory.mktemp("onevision"))
    return theirs, from_pretrained(auto_class(path), path)


def ours_call(model, batch, **changes):
    args = {k: jnp.asarray(v) if k == "pixel_values" else v
            for k, v in {**batch, **changes}.items()}
    return np.asarray(model(jnp.asarray(args.pop("input_ids")), **args))


def with_ratio(theirs, ours, aspect_ratio: str):
    """Both models switched to ``vision_aspect_ratio``."""
    theirs.config.vision_aspect_ratio = aspect_ratio
    ours.cfg = dataclasses.replace(ours.cfg, vision_aspect_ratio=aspect_ratio)


def test_onevision_logits_and_features_match_transformers(models):
    """fp32 logits within 1e-4 (``close``) on the processor's image + text inputs, padding left
    out; and each image's packed features (base tile, grid unpadded, newlines), kept at
    anyres_max_9 and shrunk at anyres_max_1, to 1e-5 of their scale (the shrunk ones' logits:
    the same placement as the kept ones', not run again)."""
    theirs, ours = models
    for aspect_ratio in ("anyres_max_1", "anyres_max_9"):
        with_ratio(theirs, ours, aspect_ratio)
        batch = inputs(aspect_ratio)
        assert batch["pixel_values"].shape[1] == 5
        assert batch["batch_num_images"].tolist() == [1, 1, 2]
        check_features(theirs, ours, batch)
    valid = batch["attention_mask"] > 0
    close(ours_call(ours, batch)[valid], torch_logits(theirs, **batch)[valid])


def check_features(theirs, ours, batch):
    """Each image's packed features, and each prompt's count its image tokens."""
    with torch.no_grad():
        want = theirs.get_image_features(**{k: torch.tensor(v) for k, v in batch.items()
                                            if k not in ("input_ids", "attention_mask")})
    want = torch.cat(want.pooler_output).numpy()
    features, counts = ours.encode(jnp.asarray(batch["pixel_values"]), batch["image_sizes"],
                                   batch["batch_num_images"])
    assert counts.tolist() == (batch["input_ids"] == IMAGE).sum(1).tolist()
    got = np.concatenate([np.asarray(f[:n]) for f, n in zip(features, counts)])
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_onevision_greedy_generation_matches_transformers(models):
    """The prefill places each prompt's packed images, the decode steps continue in text:
    transformers' greedy tokens for three left-padded prompts."""
    theirs, ours = models
    with_ratio(theirs, ours, "anyres_max_9")
    batch = inputs("anyres_max_9")
    ids, mask = batch.pop("input_ids"), batch.pop("attention_mask")
    images = {**batch, "pixel_values": jnp.asarray(batch["pixel_values"])}
    got = generate(ours, nnx.state(ours, nnx.Param), jnp.asarray(ids), 8,
                   prompt_mask=jnp.asarray(mask), encoder_inputs=images, eos_token_id=EOS,
                   pad_token_id=PAD)
    want = hf_greedy(theirs, ids, ids.shape[1], 8, EOS, PAD, attention_mask=mask, **batch)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_onevision_export_loads_back_and_refusals(tmp_path, models):
    """A zoo model saved is read by transformers with the zoo's logits (image_newline, the tower
    without SigLIP's head, a tied decoder); a prompt whose image tokens miss its images, a
    config that cannot tile, the serving engine and SFT are refused, naming why."""
    cfg = OnevisionConfig.from_hf(json.loads(hf_config(
        text_config={**TEXT, "tie_word_embeddings": True}).to_json_string()))
    ours = jiggle_ours(LlavaOnevisionForConditionalGeneration(cfg, nnx.Rngs(0)))
    save_pretrained(ours, str(tmp_path))
    back = load_hf(transformers.LlavaOnevisionForConditionalGeneration, tmp_path)
    assert back.config.image_grid_pinpoints == PINPOINTS and back.config.tie_word_embeddings
    batch = inputs("anyres_max_9")
    valid = batch["attention_mask"] > 0
    close(ours_call(ours, batch)[valid], torch_logits(back, **batch)[valid])
    with pytest.raises(ValueError, match=r"hold \[72, 42, 34\] image tokens .* pack to "
                                         r"\[72, 72, 34\] features"):
        ours_call(ours, batch, image_sizes=batch["image_sizes"][[0, 0, 2, 3]])
    with pytest.raises(ValueError, match="needs image_sizes"):
        ours_call(ours, batch, image_sizes=None)
    with pytest.raises(NotImplementedError, match="videos"):
        ours_call(ours, batch, pixel_values_videos=batch["pixel_values"][None])
    with pytest.raises(ValueError, match="vision_feature_select_strategy 'default'"):
        dataclasses.replace(cfg, vision_feature_select_strategy="default")
    with pytest.raises(NotImplementedError, match="tiled by size"):
        Engine(ours, nnx.state(ours, nnx.Param), max_len=64)
    assert "image_sizes" in ours.untrained()
