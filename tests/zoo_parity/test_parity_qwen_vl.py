"""Qwen2.5-VL (patch tower with 2-D rotary, window attention and full-attention blocks, the
2 x 2 patch merger, a Qwen2 decoder with M-RoPE) against transformers' PyTorch
``Qwen2_5_VLForConditionalGeneration``: inputs made by a real ``Qwen2_5_VLProcessor`` (its
image processor on two PIL images of different sizes drawn here, a word-level tokenizer built
here) give the same float32 logits, the same greedy tokens, and an export transformers loads
back. M-RoPE's positions are checked against transformers' ``get_rope_index``, the tower's
window ids against transformers' window order. Qwen3-VL (learned positions, DeepStack,
interleaved M-RoPE, a Qwen3 decoder) likewise on a real ``Qwen3VLProcessor``'s inputs, and
Qwen3.5 (that tower without DeepStack over the Gated DeltaNet hybrid, M-RoPE on part of each
attention head) on the same inputs. For each of the three, the serving engine's greedy tokens
on the two prompts (read in one prefill, each image's patches padded to one bucket, each row's
M-RoPE delta kept for its decode steps) are transformers' too (``engine_check``)."""
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
    scanned_tower,
    torch,
    torch_logits,
    transformers,
    word_tokenizer,
)
from PIL import Image

from redco_zoo_models.engine import Engine
from redco_zoo_models.generation import generate
from redco_zoo_models.hf import auto_class, from_pretrained, save_pretrained
from redco_zoo_models.mrope import rope_index
from redco_zoo_models.qwen_vision import patch_layout
from redco_zoo_models.qwen_vl import (
    Qwen3_5VLForConditionalGeneration,
    Qwen3VLForConditionalGeneration,
    QwenVLForConditionalGeneration,
)
from redco_zoo_models.qwen_vl_config import QwenVLConfig
from redco_zoo_models.requests import Sampling
from redco_zoo_models.toy import TINY_FAMILIES

WORDS = ["<pad>", "<unk>", "<bos>", "what", "is", "in", "this", "picture", "?", "and"]
START, END, IMAGE, VIDEO, EOS = 58, 59, 60, 61, 63
VISION = dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=4, patch_size=4,
              spatial_merge_size=2, temporal_patch_size=2, window_size=16, out_hidden_size=32,
              fullatt_block_indexes=[1, 3], hidden_act="silu")  # (windows of 2 x 2 merge
#  blocks; window, full twice: stacked, a group of the two kinds)
TEXT = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, eos_token_id=EOS, pad_token_id=0,
            bos_token_id=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "mrope_section": [2, 3, 3]})  # (16-wide heads: 8 pairs)
PIXELS = (8 * 8, 16 * 16 * 16)  # (the processor's min and max pixels)
PROMPTS = ["what is in <|vision_start|> <|image_pad|> <|vision_end|> this picture ?",
           "<|vision_start|> <|image_pad|> <|vision_end|> and <|vision_start|> <|image_pad|> "
           "<|vision_end|> ?"]
SIZES = [[(40, 24)], [(16, 32), (56, 40)]]  # (height, width) of each prompt's images


def qwen_config():
    return transformers.Qwen2_5_VLConfig(vision_config=VISION, text_config=TEXT,
                                         image_token_id=IMAGE, video_token_id=VIDEO,
                                         vision_start_token_id=START, vision_end_token_id=END)


def images_only(processor_class):
    """``processor_class`` as it is, less its video processor (which needs torchvision)."""

    class ImagesOnly(processor_class):
        def __init__(self, image_processor, tokenizer):
            super().__init__(image_processor, tokenizer)
    return ImagesOnly


def qwen_processor(processor_class):
    """A real Qwen2_5_VLProcessor or Qwen3VLProcessor: its image processor (resize to multiples of 8 pixels,
    normalise, flatten 4 x 4 patches of two frames) and a word-level tokenizer."""
    vocab = {**{w: i for i, w in enumerate(WORDS)}, "<|vision_start|>": START,
             "<|vision_end|>": END, "<|image_pad|>": IMAGE, "<|video_pad|>": VIDEO,
             "<|endoftext|>": EOS}
    tokenizer = word_tokenizer(vocab, pad_token="<pad>", bos_token="<bos>",
                               eos_token="<|endoftext|>",
                               extra_special_tokens={"image_token": "<|image_pad|>",
                                                     "video_token": "<|video_pad|>"})
    images = transformers.Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2,
                                                   merge_size=2, min_pixels=PIXELS[0],
                                                   max_pixels=PIXELS[1])
    return processor_class(images, tokenizer)


def processed(processor_class) -> dict:
    """The processor's arrays for two left-padded prompts holding 1 and 2 images of 3 sizes."""
    rng = np.random.RandomState(0)
    pil = [[Image.fromarray((rng.rand(h, w, 3) * 255).astype(np.uint8)) for h, w in row]
           for row in SIZES]
    out = qwen_processor(processor_class)(images=pil, text=PROMPTS, padding=True,
                                          return_tensors="np")
    return {k: np.asarray(v) for k, v in out.items()}


@pytest.fixture(scope="module")
def batch() -> dict:
    return processed(images_only(transformers.Qwen2_5_VLProcessor))


@pytest.fixture(scope="module")
def saved_qwen(tmp_path_factory):
    """transformers' tiny Qwen2.5-VL (weights jiggled) and the directory of its save."""
    theirs = jiggle_torch(transformers.Qwen2_5_VLForConditionalGeneration(qwen_config()))
    return theirs, saved(theirs, tmp_path_factory.mktemp("qwen_vl"))


@pytest.fixture(scope="module")
def models(saved_qwen):
    """transformers' tiny Qwen2.5-VL and ours read from its save."""
    theirs, path = saved_qwen
    return theirs, from_pretrained(auto_class(path), path)


def ours_logits(ours, batch):
    return np.asarray(ours(jnp.asarray(batch["input_ids"]),
                           jnp.asarray(batch["attention_mask"]),
                           jnp.asarray(batch["pixel_values"]), batch["image_grid_thw"]))


def theirs_logits(theirs, batch):
    return torch_logits(theirs, **{k: v for k, v in batch.items()})


def test_the_processor_gives_images_of_three_sizes(batch):
    """The inputs test what they should: three grids, windows cut by the images' edges."""
    grids = batch["image_grid_thw"].tolist()
    assert grids == [[1, 10, 6], [1, 4, 8], [1, 14, 10]], grids
    assert (batch["input_ids"] == IMAGE).sum() == (60 + 32 + 140) // 4


def test_mrope_positions_and_windows_match_transformers(models, batch):
    """M-RoPE's positions and deltas equal ``get_rope_index``'s; the tower's window ids group
    exactly the patches transformers' window order puts in one window."""
    theirs, ours = models
    want, want_deltas = theirs.model.get_rope_index(
        torch.tensor(batch["input_ids"]), torch.tensor(batch["mm_token_type_ids"]),
        image_grid_thw=torch.tensor(batch["image_grid_thw"]),
        attention_mask=torch.tensor(batch["attention_mask"]))
    got, deltas = rope_index(batch["input_ids"], batch["attention_mask"],
                             batch["image_grid_thw"], IMAGE, 2)
    valid = batch["attention_mask"] > 0
    np.testing.assert_array_equal(got[:, valid], want.numpy()[:, valid])
    np.testing.assert_array_equal(deltas, want_deltas.numpy()[:, 0])
    from transformers.vision_utils import get_vision_window_index
    order, bounds = get_vision_window_index(torch.tensor(batch["image_grid_thw"]), 2, 16, 4)
    units = patch_layout(batch["image_grid_thw"], ours.cfg.vision)["window"][::4]
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        members = order.numpy()[lo // 4:hi // 4]  # (merge blocks of one window)
        assert len(set(units[members])) == 1
        assert (units == units[members[0]]).sum() == len(members)


def test_qwen_vl_logits_match_transformers(models, batch):
    """fp32 logits within 1e-4 (``close``) on left-padded image + text rows; the tower's merged
    features to 1e-5 of their scale."""
    theirs, ours = models
    assert logits_and_features_match(ours, theirs, batch) == []


def logits_and_features_match(ours, theirs, batch) -> list:
    """Assert ``ours``' logits (at the valid tokens) and merged image features are
    ``theirs``'; returns our DeepStack features."""
    valid = batch["attention_mask"] > 0
    close(ours_logits(ours, batch)[valid], theirs_logits(theirs, batch)[valid])
    with torch.no_grad():
        want = torch.cat(theirs.get_image_features(
            torch.tensor(batch["pixel_values"]),
            torch.tensor(batch["image_grid_thw"])).pooler_output).numpy()
    got, deep = ours.image_features(jnp.asarray(batch["pixel_values"]), batch["image_grid_thw"])
    assert np.abs(np.asarray(got) - want).max() <= 1e-5 * np.abs(want).max()
    return deep


def test_qwen_vl_scanned_tower_matches_transformers(saved_qwen, batch, tmp_path):
    """With ``scan_layers`` the tower's window and full-attention blocks are stacked as one
    repeating group of the two kinds (``visual/blocks/0:4:2``, ``1:4:2``) and scanned: the
    same logits within 1e-4 and features to 1e-5 of their scale; the export is the unrolled
    model's, tensor for tensor."""
    theirs, path = saved_qwen
    ours = scanned_tower(path, "visual/blocks/", tmp_path)
    assert [(s.start, s.period, s.repeats) for s in ours.visual.runs] == [(0, 2, 2)]
    logits_and_features_match(ours, theirs, batch)


def test_qwen_vl_greedy_generation_matches_transformers(models, batch):
    """Generated tokens placed by each row's M-RoPE delta: greedy tokens equal, from generate
    and from the serving engine (``check_greedy``)."""
    theirs, ours = models
    check_greedy(ours, theirs, batch)


def check_greedy(ours, theirs, batch):
    """transformers' greedy tokens (8, each row's M-RoPE delta nonzero) are ``generate``'s on
    the left-padded batch, and the serving engine's on its two prompts read in one prefill
    (``engine_check``)."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    encoder_inputs = {"pixel_values": jnp.asarray(batch["pixel_values"]),
                      "image_grid_thw": batch["image_grid_thw"], "input_ids": ids,
                      "attention_mask": mask}
    got = generate(ours, nnx.state(ours, nnx.Param), jnp.asarray(ids), 8,
                   prompt_mask=jnp.asarray(mask), encoder_inputs=encoder_inputs,
                   eos_token_id=EOS, pad_token_id=0)
    want = hf_greedy(theirs, ids, ids.shape[1], 8, EOS, 0, attention_mask=mask,
                     pixel_values=batch["pixel_values"],
                     image_grid_thw=batch["image_grid_thw"],
                     mm_token_type_ids=batch["mm_token_type_ids"])
    np.testing.assert_array_equal(np.asarray(got), want)
    engine_check(ours, batch, want)


def engine_check(ours, batch, want):
    """The engine (``engine_image_buckets.PatchSlots``) on the batch's prompts unpadded, each with its
    own images' patches (60; 32 + 140) padded to one bucket of 256 in one prefill: the decode
    steps' positions come from the delta each row keeps; a prompt over the bucket, images not
    the processor's arrays, or grids that are not the prompt's image tokens are refused."""
    mask, grids = batch["attention_mask"] > 0, batch["image_grid_thw"]
    ends = np.cumsum(np.prod(grids, -1))
    split = np.split(batch["pixel_values"], ends[:-1])
    images = [{"pixel_values": np.concatenate(split[:1]), "image_grid_thw": grids[:1]},
              {"pixel_values": np.concatenate(split[1:]), "image_grid_thw": grids[1:]}]
    engine = Engine(ours, nnx.state(ours, nnx.Param), max_seqs=2, max_len=64,
                    eos_token_ids=(EOS,), max_images=2, max_image_patches=256)
    requests = [engine.submit(batch["input_ids"][b][mask[b]].tolist(), Sampling(max_tokens=8),
                              images=images[b]) for b in range(2)]
    engine.run_until_done(requests)
    got = [r.samples[0].tokens + [0] * (8 - len(r.samples[0].tokens)) for r in requests]
    np.testing.assert_array_equal(np.array(got), want)
    with pytest.raises(ValueError, match="give 172 patches; this engine pads a prompt's to 160"
                                         ".*--max_image_patches"):
        dataclasses.replace(engine.images, patches=160).check(requests[1].prompt, images[1])
    with pytest.raises(ValueError, match="give {'pixel_values', 'image_grid_thw'}"):
        engine.submit(requests[1].prompt, Sampling(max_tokens=8), images=images[1]["pixel_values"])
    with pytest.raises(ValueError, match="image tokens do not match image_grid_thw"):
        engine.submit(requests[1].prompt, Sampling(max_tokens=8), images=images[0])


def test_qwen_vl_export_loads_back_and_bad_inputs_are_refused(tmp_path, batch):
    config = json.loads(qwen_config().to_json_string())
    ours = jiggle_ours(QwenVLForConditionalGeneration(QwenVLConfig.from_hf(config),
                                                      nnx.Rngs(0)))
    save_pretrained(ours, str(tmp_path))
    back = load_hf(transformers.Qwen2_5_VLForConditionalGeneration, tmp_path)
    assert back.config.vision_config.fullatt_block_indexes == [1, 3]
    assert back.config.text_config.rope_parameters["mrope_section"] == [2, 3, 3]
    valid = batch["attention_mask"] > 0
    close(ours_logits(ours, batch)[valid], theirs_logits(back, batch)[valid])
    wrong = {**batch, "image_grid_thw": batch["image_grid_thw"][::-1]}  # (sizes swapped)
    with pytest.raises(ValueError, match="image tokens do not match image_grid_thw"):
        ours_logits(ours, wrong)
    video = {**batch, "input_ids": np.where(batch["input_ids"] == 3, VIDEO, batch["input_ids"])}
    with pytest.raises(ValueError, match="read images, not videos yet"):
        ours_logits(ours, video)
    with pytest.raises(ValueError, match="not interleaved"):
        QwenVLConfig.from_hf({**config, "text_config": {
            **config["text_config"], "rope_parameters": {
                **config["text_config"]["rope_parameters"], "mrope_interleaved": True}}})
    with pytest.raises(ValueError, match="must sum to the 8 rotary pairs"):
        QwenVLConfig.from_hf({**config, "text_config": {
            **config["text_config"], "rope_parameters": {"rope_type": "default",
                                                         "mrope_section": [2, 2, 2]}}})


VISION3 = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=4, patch_size=4,
               spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=32,
               num_position_embeddings=16, deepstack_visual_indexes=[0, 1])  # (a 4 x 4 table)
TEXT3 = dict(TEXT, num_hidden_layers=3, head_dim=16, rope_parameters={
    "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
    "mrope_interleaved": True})


def qwen3_config():
    return transformers.Qwen3VLConfig(vision_config=VISION3, text_config=TEXT3,
                                      image_token_id=IMAGE, video_token_id=VIDEO,
                                      vision_start_token_id=START, vision_end_token_id=END)


@pytest.fixture(scope="module")
def batch3() -> dict:
    return processed(images_only(transformers.Qwen3VLProcessor))


def test_qwen3_vl_logits_greedy_tokens_and_export_match_transformers(tmp_path, batch3):
    """Qwen3-VL (learned positions resampled to each grid, DeepStack after decoder layers 0
    and 1, interleaved M-RoPE, Qwen3's q/k norms) on a real ``Qwen3VLProcessor``'s inputs:
    fp32 logits within 1e-4, the features and both DeepStack sets to 1e-5 of their scale, greedy
    tokens, and an export transformers loads back with the same logits."""
    batch = batch3
    theirs = jiggle_torch(transformers.Qwen3VLForConditionalGeneration(qwen3_config()))
    ours = from_pretrained(auto_class(saved(theirs, tmp_path / "theirs")),
                           str(tmp_path / "theirs"))
    assert isinstance(ours, Qwen3VLForConditionalGeneration)
    valid = batch["attention_mask"] > 0
    close(ours_logits(ours, batch)[valid], theirs_logits(theirs, batch)[valid])
    with torch.no_grad():
        out = theirs.get_image_features(torch.tensor(batch["pixel_values"]),
                                        torch.tensor(batch["image_grid_thw"]))
    got, deep = ours.image_features(jnp.asarray(batch["pixel_values"]), batch["image_grid_thw"])
    for a, b in zip([got, *deep], [out.pooler_output, *out.deepstack_features]):
        b = torch.cat(b).numpy()  # (split by image)
        assert np.abs(np.asarray(a) - b).max() <= 1e-5 * np.abs(b).max()
    assert len(deep) == 2
    check_greedy(ours, theirs, batch)
    save_pretrained(ours, str(tmp_path / "ours"))
    back = load_hf(transformers.Qwen3VLForConditionalGeneration, tmp_path / "ours")
    close(ours_logits(ours, batch)[valid], theirs_logits(back, batch)[valid])
    check_scanned_deepstack(theirs, out, tmp_path, batch)


def check_scanned_deepstack(theirs, out, tmp_path, batch):
    """With ``scan_layers`` the tower's three blocks are one stack (``visual/blocks/0:3``)
    under one scan, the DeepStack taps after blocks 0 and 1 read from its outputs: the same
    logits within 1e-4, features and taps to 1e-5 of their scale (``out``: transformers'),
    an export equal to the unrolled model's."""
    ours = scanned_tower(tmp_path / "theirs", "visual/blocks/", tmp_path)
    valid = batch["attention_mask"] > 0
    close(ours_logits(ours, batch)[valid], theirs_logits(theirs, batch)[valid])
    got, deep = ours.image_features(jnp.asarray(batch["pixel_values"]), batch["image_grid_thw"])
    assert len(deep) == 2
    for a, b in zip([got, *deep], [out.pooler_output, *out.deepstack_features]):
        b = torch.cat(b).numpy()
        assert np.abs(np.asarray(a) - b).max() <= 1e-5 * np.abs(b).max()


VISION3_5 = {k: v for k, v in VISION3.items() if k != "deepstack_visual_indexes"}
TEXT3_5 = dict(TINY_FAMILIES["qwen3.5"], head_dim=16, rope_parameters={  # (8 of 16 turn: 4 pairs)
    "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
    "mrope_section": [2, 1, 1], "mrope_interleaved": True})


def test_qwen3_5_logits_greedy_tokens_and_export_match_transformers(tmp_path, batch3):
    """Qwen3.5 (Qwen3-VL's tower without DeepStack, the Gated DeltaNet hybrid decoder whose
    attention layer turns half of each head by interleaved M-RoPE) on the Qwen3-VL processor's
    inputs: fp32 logits within 1e-4, the features to 1e-5 of their scale, greedy tokens, an
    export transformers loads back with the same logits; its checkpoint is read as its language
    model unless images are asked for; the serving engine's greedy tokens too."""
    theirs = jiggle_torch(transformers.Qwen3_5ForConditionalGeneration(transformers.Qwen3_5Config(
        vision_config=VISION3_5, text_config=TEXT3_5, image_token_id=IMAGE,
        video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)))
    path = saved(theirs, tmp_path / "theirs")
    assert auto_class(path).__name__ == "DecoderLM"  # (test_parity_gated_deltanet: text alone)
    ours = from_pretrained(auto_class(path, images=True), path)
    assert isinstance(ours, Qwen3_5VLForConditionalGeneration) and not ours.cfg.vision.DEEPSTACK
    valid = batch3["attention_mask"] > 0
    close(ours_logits(ours, batch3)[valid], theirs_logits(theirs, batch3)[valid])
    with torch.no_grad():
        want = torch.cat(theirs.get_image_features(
            torch.tensor(batch3["pixel_values"]),
            torch.tensor(batch3["image_grid_thw"])).pooler_output).numpy()
    got, deep = ours.image_features(jnp.asarray(batch3["pixel_values"]), batch3["image_grid_thw"])
    assert deep == [] and np.abs(np.asarray(got) - want).max() <= 1e-5 * np.abs(want).max()
    check_greedy(ours, theirs, batch3)
    save_pretrained(ours, str(tmp_path / "ours"))
    back = load_hf(transformers.Qwen3_5ForConditionalGeneration, tmp_path / "ours")
    text = back.config.text_config
    assert (text.rope_parameters["mrope_section"], text.layer_types) == ([2, 1, 1],
                                                                         TEXT3_5["layer_types"])
    close(ours_logits(ours, batch3)[valid], theirs_logits(back, batch3)[valid])


def test_qwen3_5_moe_checkpoint_round_trips_through_the_zoo(tmp_path):
    """Qwen3.5's MoE (``qwen3_5_moe``: the same wiring, test above, over the MoE hybrid, whose
    logits test_parity_gated_deltanet checks) read from transformers' save as the image + text
    model and written back: transformers loads it with every tensor equal (nothing compiled)."""
    text = dict(TINY_FAMILIES["qwen3.5-moe"], **{k: TEXT3_5[k] for k in ("head_dim",
                                                                          "rope_parameters")})
    theirs = jiggle_torch(transformers.Qwen3_5MoeForConditionalGeneration(
        transformers.Qwen3_5MoeConfig(vision_config=VISION3_5, text_config=text,
                                      image_token_id=IMAGE, video_token_id=VIDEO)))
    path = saved(theirs, tmp_path / "theirs")
    ours = from_pretrained(auto_class(path, images=True), path)
    assert type(ours).__name__ == "Qwen3_5MoeVLForConditionalGeneration"
    save_pretrained(ours, str(tmp_path / "ours"))
    back = load_hf(transformers.Qwen3_5MoeForConditionalGeneration, tmp_path / "ours")
    want, got = theirs.state_dict(), back.state_dict()
    assert set(got) == set(want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)
