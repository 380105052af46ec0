"""Idefics3 and SmolVLM (SigLIP's layers + pixel shuffle + a bias-free projection + Llama) against
transformers' PyTorch models: inputs made by a real ``Idefics3Processor`` (its image processor
splitting PIL images drawn here into tiles plus a global one, a word-level tokenizer built here)
give the same float32 logits, the same greedy tokens, and an export (as ``smolvlm`` too) that
transformers loads back."""
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
from redco_zoo_models.idefics3 import Idefics3Config, Idefics3ForConditionalGeneration
from redco_zoo_models.requests import Sampling

WORDS = ["<unk>", "<s>", "User:", "Assistant:", "what", "is", "in", "this", "picture", "?"]
SPECIAL = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
           *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7))]
IMAGE, PAD, EOS = 11, 62, 63
TEXT = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, eos_token_id=EOS,
            pad_token_id=PAD)
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              image_size=32, patch_size=8)
PROMPTS = ["User: <image> what is in this picture ? Assistant:", "<image> <image> picture ?"]
SIZES = [[(40, 90)], [(50, 30), (20, 20)]]  # (height, width) of each prompt's images


def inputs() -> dict:
    """The processor's arrays (left-padded): prompt 0 is 2 tiles + a global one, prompt 1 two
    images of 4 + 1; prompt 0's 7 padding tiles all zeros."""
    vocab = {**{w: i for i, w in enumerate(WORDS)}, **{t: 10 + i for i, t in enumerate(SPECIAL)},
             "<pad>": PAD, "</s>": EOS}
    tokenizer = word_tokenizer(vocab, pad_token="<pad>", eos_token="</s>",
                               additional_special_tokens=SPECIAL)
    images = transformers.Idefics3ImageProcessorPil(size={"longest_edge": 64},
                                                    max_image_size={"longest_edge": 32})
    processor = transformers.Idefics3Processor(image_processor=images, tokenizer=tokenizer,
                                               image_seq_len=4)
    rng = np.random.RandomState(0)
    drawn = [[Image.fromarray((rng.rand(h, w, 3) * 255).astype(np.uint8)) for h, w in sizes]
             for sizes in SIZES]
    out = processor(images=drawn, text=PROMPTS, padding=True, return_tensors="np")
    return {k: np.asarray(v) for k, v in out.items()}


def hf_config(**changes):
    return transformers.Idefics3Config(**{**dict(vision_config=VISION, text_config=TEXT,
                                                 image_token_id=IMAGE), **changes})


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """transformers' tiny Idefics3 (weights jiggled), the zoo's from its checkpoint, inputs."""
    theirs = jiggle_torch(transformers.Idefics3ForConditionalGeneration(hf_config()))
    path = saved(theirs, tmp_path_factory.mktemp("idefics3"))
    return theirs, from_pretrained(auto_class(path), path), inputs()


def ours_call(model, batch, **changes):
    args = {k: jnp.asarray(v) for k, v in {**batch, **changes}.items()}
    return np.asarray(model(args.pop("input_ids"), **args))


def test_idefics3_logits_and_greedy_tokens_match_transformers(models):
    """fp32 logits within 1e-4 (``close``) on the processor's image + text inputs, padding left
    out; transformers' greedy tokens, the real tiles encoded once at the prefill."""
    theirs, ours, batch = models
    assert batch["pixel_values"].shape[1] == 10
    valid = batch["attention_mask"] > 0
    close(ours_call(ours, batch)[valid], torch_logits(theirs, **batch)[valid])
    ids, mask = batch["input_ids"], batch["attention_mask"]
    got = generate(ours, nnx.state(ours, nnx.Param), jnp.asarray(ids), 8,
                   prompt_mask=jnp.asarray(mask),
                   encoder_inputs={"pixel_values": jnp.asarray(batch["pixel_values"])},
                   eos_token_id=EOS, pad_token_id=PAD)
    want = hf_greedy(theirs, ids, ids.shape[1], 8, EOS, PAD, attention_mask=mask,
                     pixel_values=batch["pixel_values"],
                     pixel_attention_mask=batch["pixel_attention_mask"])
    np.testing.assert_array_equal(np.asarray(got), want)
    check_engine(ours, theirs, batch, want)


def check_engine(ours, theirs, batch, want):
    """The serving engine reads both prompts (3 and 10 tiles; padding tokens and tiles dropped,
    the shorter right-padded) in one prefill of 10 tile slots, each row's tiles at its own image
    tokens in order, the blank slots unused: transformers' greedy tokens (``want``), and each
    token's log-probability transformers' forward ``log_softmax`` to 1e-4; more tiles than
    slots are refused naming ``--max_images``."""
    valid = batch["attention_mask"] > 0
    prompts = [[int(t) for t in row[m]] for row, m in zip(batch["input_ids"], valid)]
    engine = Engine(ours, nnx.state(ours, nnx.Param), max_seqs=2, max_len=96,
                    eos_token_ids=(EOS,), steps_per_sync=8, max_images=10)
    read, prefill = [], engine._prefill  # (the prompts each prefill reads)
    engine._prefill = lambda *args: read.append(len(args[4])) or prefill(*args)
    requests = [engine.submit(p, Sampling(max_tokens=want.shape[1]),
                              images=batch["pixel_values"][i:i + 1])
                for i, p in enumerate(prompts)]
    engine.run_until_done(requests)
    assert read == [2]  # both prompts in one prefill
    samples = [r.samples[0] for r in requests]
    got = [s.tokens + [PAD] * (want.shape[1] - len(s.tokens)) for s in samples]
    np.testing.assert_array_equal(np.array(got), want)
    rows = [p + s.tokens for p, s in zip(prompts, samples)]
    width = max(map(len, rows))
    full = np.array([r + [PAD] * (width - len(r)) for r in rows])  # (right-padded, per row)
    mask = (np.arange(width) < np.array([len(r) for r in rows])[:, None]) * 1
    logprobs = torch.log_softmax(torch.tensor(torch_logits(
        theirs, input_ids=full, attention_mask=mask, pixel_values=batch["pixel_values"],
        pixel_attention_mask=batch["pixel_attention_mask"])), -1).numpy()
    for row, (prompt, sample) in enumerate(zip(prompts, samples)):
        at = np.arange(len(sample.tokens)) + len(prompt) - 1
        np.testing.assert_allclose(sample.logprobs, logprobs[row, at, sample.tokens], atol=1e-4)
    twice = np.concatenate([batch["pixel_values"][1:]] * 2, 1)
    with pytest.raises(ValueError, match=r"give 20 tiles.*--max_images 20"):
        engine.submit(prompts[1], Sampling(max_tokens=1), images=twice)


def test_idefics3_published_towers_give_each_patch_its_position():
    """The zoo's tower puts a whole tile's patches at positions 0, 1, ... (SigLIP's); so do
    transformers' buckets at the published towers' 26, 27 and 32 patches a side."""
    embeddings = transformers.models.idefics3.modeling_idefics3.Idefics3VisionEmbeddings
    for side in (26, 27, 32):
        theirs = embeddings(transformers.Idefics3VisionConfig(hidden_size=4, image_size=side,
                                                              patch_size=1))
        with torch.no_grad():
            theirs.patch_embedding.weight.zero_(), theirs.patch_embedding.bias.zero_()
            theirs.position_embedding.weight.copy_(torch.arange(side * side)[:, None].repeat(1, 4))
            got = theirs(torch.zeros(1, 3, side, side), torch.ones(1, side, side, dtype=bool))
        np.testing.assert_array_equal(got[0, :, 0].numpy(), np.arange(side * side), err_msg=side)


@pytest.mark.parametrize("model_type", ["idefics3", "smolvlm"])
def test_idefics3_export_loads_back_and_refusals(tmp_path, models, model_type):
    """A zoo model saved (as Idefics3 or SmolVLM) is read by transformers with the zoo's logits;
    image tokens that miss the tiles, part-masked tiles and SFT are refused."""
    _, _, batch = models
    config = json.loads(hf_config(text_config={**TEXT, "tie_word_embeddings": True},
                                  scale_factor=4).to_json_string())
    cfg = Idefics3Config.from_hf({**config, "model_type": model_type})
    ours = jiggle_ours(Idefics3ForConditionalGeneration(cfg, nnx.Rngs(0)))
    save_pretrained(ours, str(tmp_path))
    cls = {"idefics3": transformers.Idefics3ForConditionalGeneration,
           "smolvlm": transformers.SmolVLMForConditionalGeneration}[model_type]
    back = load_hf(cls, tmp_path)
    assert back.config.scale_factor == 4 and back.config.tie_word_embeddings
    ids = batch["input_ids"].copy()
    ids[ids == IMAGE] = np.where(np.arange((ids == IMAGE).sum()) % 4 == 0, IMAGE, 4)  # 1 a tile
    one = {**batch, "input_ids": ids}
    valid = one["attention_mask"] > 0
    close(ours_call(ours, one)[valid], torch_logits(back, **one)[valid])
    with pytest.raises(ValueError, match=r"hold \[12, 40\] image tokens .* give \[3, 10\]"):
        ours_call(ours, batch)
    part = batch["pixel_attention_mask"].copy()
    part[0, 0, :, -1] = 0
    with pytest.raises(ValueError, match="masks part of a tile"):
        ours_call(ours, one, pixel_attention_mask=part)
    assert "tiles" in ours.untrained()
