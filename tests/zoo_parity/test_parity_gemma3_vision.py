"""Gemma 3 with images (SigLIP tower, pooled soft tokens, a Gemma 3 text decoder whose image
tokens see each other both ways) against transformers' PyTorch
``Gemma3ForConditionalGeneration``: inputs made by a real ``Gemma3Processor`` (its image
processor on PIL images drawn here, a word-level tokenizer built here; its ``token_type_ids``
switch transformers' bidirectional image attention on) give the same float32 logits, the same
greedy tokens, and an export transformers loads back."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from parity import (
    close,
    engine_reads_in_one_prefill,
    hf_greedy,
    jiggle_ours,
    jiggle_torch,
    load_hf,
    logprobs_match,
    saved,
    scanned_tower,
    torch,
    torch_logits,
    transformers,
    word_tokenizer,
)
from PIL import Image

from redco_zoo_models.engine import Engine
from redco_zoo_models.gemma3_vision import Gemma3ForConditionalGeneration, Gemma3VisionConfig
from redco_zoo_models.generation import generate
from redco_zoo_models.hf import auto_class, from_pretrained, save_pretrained

WORDS = ["<pad>", "<unk>", "<bos>", "what", "is", "in", "this", "picture", "?"]
BOI, EOI, IMAGE, EOS = 58, 59, 60, 63
VISION = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=48,
              num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8)
TEXT = dict(model_type="gemma3_text", vocab_size=64, hidden_size=32, intermediate_size=48,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            sliding_window=3, layer_types=["sliding_attention", "full_attention"],
            eos_token_id=EOS, pad_token_id=0)  # (a window shorter than an image's 4 tokens)
PROMPTS = ["what is in <start_of_image> this picture ?", "<start_of_image> picture ?"]


def gemma3_config():
    return transformers.Gemma3Config(vision_config=VISION, text_config=TEXT,
                                     mm_tokens_per_image=4, boi_token_index=BOI,
                                     eoi_token_index=EOI, image_token_index=IMAGE)


def gemma3_processor():
    """A real Gemma3Processor: its image processor (resize to 32, normalise) and a word-level
    tokenizer with Gemma 3's image tokens; each image pooled to 4 soft tokens."""
    vocab = {**{w: i for i, w in enumerate(WORDS)}, "<start_of_image>": BOI,
             "<end_of_image>": EOI, "<image_soft_token>": IMAGE, "<eos>": EOS}
    tokenizer = word_tokenizer(vocab, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                               extra_special_tokens={"image_token": "<image_soft_token>",
                                                     "boi_token": "<start_of_image>",
                                                     "eoi_token": "<end_of_image>"})
    images = transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    return transformers.Gemma3Processor(image_processor=images, tokenizer=tokenizer,
                                        image_seq_length=4)


def inputs() -> dict:
    """The processor's arrays (``token_type_ids`` too) for two left-padded prompts with one PIL
    image each."""
    rng = np.random.RandomState(0)
    pil = [[Image.fromarray((rng.rand(40, 48, 3) * 255).astype(np.uint8))] for _ in PROMPTS]
    out = gemma3_processor()(images=pil, text=PROMPTS, padding=True, return_tensors="np")
    return {k: np.asarray(v) for k, v in out.items()}


def check_logits(ours, theirs, batch):
    """Ours (which finds the image tokens itself) against transformers' with the processor's
    ``token_type_ids``, padding left out."""
    args = {k: jnp.asarray(v) for k, v in batch.items() if k != "token_type_ids"}
    got = np.asarray(ours(args.pop("input_ids"), **args))
    valid = batch["attention_mask"] > 0
    close(got[valid], torch_logits(theirs, **batch)[valid])


def test_gemma3_vision_logits_match_transformers(tmp_path):
    """fp32 logits within 1e-4 (``close``) on image + text through a sliding layer (window 3)
    and a global one; the pooled, normed, projected image features to 1e-5 of their scale;
    the same with ``scan_layers`` (the tower's layers stacked and scanned too)."""
    theirs = jiggle_torch(transformers.Gemma3ForConditionalGeneration(gemma3_config()))
    path = saved(theirs, tmp_path)
    ours = from_pretrained(auto_class(path), path)
    batch = inputs()
    assert (batch["input_ids"] == IMAGE).sum() == 8 and batch["token_type_ids"].sum() == 8
    check_logits(ours, theirs, batch)
    with torch.no_grad():
        want = theirs.get_image_features(torch.tensor(batch["pixel_values"])).pooler_output
    got = np.asarray(ours.encode(jnp.asarray(batch["pixel_values"])))
    assert np.abs(got - want.numpy()).max() <= 1e-5 * np.abs(want.numpy()).max()
    scanned = scanned_tower(path, "vision_tower/encoder/layers/", tmp_path)  # (SigLIP's 2
    check_logits(scanned, theirs, batch)  # layers one stack, scanned; its export unrolled's)
    got = np.asarray(scanned.encode(jnp.asarray(batch["pixel_values"])))
    assert np.abs(got - want.numpy()).max() <= 1e-5 * np.abs(want.numpy()).max()


def test_gemma3_vision_greedy_generation_matches_transformers(tmp_path):
    """The prefill into the cache (``decode`` at slot 0, as ``generate`` reads a prompt) gives
    transformers' logits with the images seen both ways; then the greedy tokens are equal, and
    the serving engine's too (``check_engine``)."""
    theirs = jiggle_torch(transformers.Gemma3ForConditionalGeneration(gemma3_config()))
    ours = from_pretrained(Gemma3ForConditionalGeneration, saved(theirs, tmp_path))
    batch = inputs()
    ids, mask, pixels = batch["input_ids"], batch["attention_mask"], batch["pixel_values"]
    key_valid = jnp.pad(jnp.asarray(mask) > 0, ((0, 0), (0, 8)), constant_values=True)
    prefill, _ = ours.decode(jnp.asarray(ids), key_valid, ours.init_cache(2, ids.shape[1] + 8),
                             0, ours.encode(jnp.asarray(pixels)))
    close(np.asarray(prefill)[mask > 0], torch_logits(theirs, **batch)[mask > 0])
    got = generate(ours, nnx.state(ours, nnx.Param), jnp.asarray(ids), 8,
                   prompt_mask=jnp.asarray(mask),
                   encoder_inputs={"pixel_values": jnp.asarray(pixels)},
                   eos_token_id=EOS, pad_token_id=0)
    want = hf_greedy(theirs, ids, ids.shape[1], 8, EOS, 0, attention_mask=mask,
                     pixel_values=pixels, token_type_ids=batch["token_type_ids"])
    np.testing.assert_array_equal(np.asarray(got), want)
    check_engine(ours, batch, want)


def check_engine(ours, batch, want):
    """The serving engine reads both prompts (padding dropped, each with its own image) in one
    prefill, the shorter right-padded, each row's images seen both ways in that row only: its
    greedy tokens are transformers' (``want``, cut after EOS), and each token's log-probability
    is the forward pass's ``log_softmax`` (images both ways) to 1e-4."""
    ids, mask, pixels = batch["input_ids"], batch["attention_mask"], batch["pixel_values"]
    prompts = [[int(t) for t in row[m > 0]] for row, m in zip(ids, mask)]
    assert len(set(map(len, prompts))) == 2  # (the shorter one is padded in the prefill)
    engine = Engine(ours, nnx.state(ours, nnx.Param), max_seqs=2, max_len=32,
                    eos_token_ids=(EOS,), steps_per_sync=8)
    samples, full, valid = engine_reads_in_one_prefill(
        engine, prompts, [pixels[i:i + 1] for i in range(len(prompts))], want)
    logits = ours(jnp.asarray(full), jnp.asarray(valid), jnp.asarray(pixels[:, None]))
    logprobs_match(prompts, samples, np.asarray(jax.nn.log_softmax(logits, -1)))


def test_gemma3_vision_export_loads_back_and_bad_configs_are_refused(tmp_path):
    config = json.loads(gemma3_config().to_json_string())
    ours = jiggle_ours(Gemma3ForConditionalGeneration(Gemma3VisionConfig.from_hf(config),
                                                      nnx.Rngs(0)))
    save_pretrained(ours, str(tmp_path))
    back = load_hf(transformers.Gemma3ForConditionalGeneration, tmp_path)
    assert back.config.mm_tokens_per_image == 4 and back.config.image_token_index == IMAGE
    check_logits(ours, back, inputs())
    text = {"input_ids": np.array([[2, 3, 4, 5, 6, 7, 8]])}  # text alone: causal, no images
    close(np.asarray(ours(jnp.asarray(text["input_ids"]))), torch_logits(back, **text))
    with pytest.raises(ValueError, match="mm_tokens_per_image 3: it must be a square"):
        Gemma3VisionConfig.from_hf({**config, "mm_tokens_per_image": 3})
    with pytest.raises(ValueError, match="'clip_vision_model' tower"):
        Gemma3VisionConfig.from_hf({**config, "vision_config": {"model_type":
                                                                "clip_vision_model"}})
