"""``redco serve`` over a tiny LLaVA (``toy_vision``: its real ``LlavaProcessor``) and a tiny
Gemma 3 (its real ``Gemma3Processor``; image tokens seen both ways in the prefill), asked by the
real ``openai`` client with a PNG sent as a ``data:`` URL: its greedy answer is transformers'
``generate`` on the same image and prompt (the processor's own arrays). A tiny Qwen2.5-VL
(``toy_vision.save_tiny_qwen_vl``: its images at their own sizes, M-RoPE) answers two images of
other sizes as ``Qwen2_5_VLForConditionalGeneration.generate`` does. The servers run in this
process (``served_in_process``: the command's ``start_engine`` and ``build_app``, reached
through starlette's test client): ``redco serve`` as a process, its socket and its HTTP
server are tested in test_serve.py. An unreadable image and an image sent to a text-only
model are a 400 naming the fix. Gemma 4's processor, as the command loads it, gives the engine
its patches and their places."""
import argparse
import base64
import io

import jax
import numpy as np
import openai
import pytest
import torch
import transformers
from flax import nnx
from PIL import Image
from redco_serve.app import build_app, chat_text
from redco_serve.command import ServeCommand, image_processor, start_engine
from redco_serve.images import chat_with_images
from starlette.testclient import TestClient
from test_serve import WORDS as TEXT_WORDS
from transformers import AutoTokenizer

from redco_zoo_models.engine import Engine
from redco_zoo_models.engine_image_buckets import PlacedPatchSlots, TileSlots
from redco_zoo_models.engine_images import check_images, image_slots
from redco_zoo_models.gemma4_vision_config import Gemma4VisionConfig
from redco_zoo_models.hf import auto_class, from_pretrained, save_pretrained
from redco_zoo_models.toy import TINY_FAMILIES, chat_word_tokenizer, save_tiny_chat_model
from redco_zoo_models.toy_vision import save_tiny_gemma3, save_tiny_llava, save_tiny_qwen_vl

WORDS = ["system", "user", "assistant", "what", "is", "this", "?", "red", "green", "blue",
         "circle", "square", "a", "the"]
N_NEW = 6


def png_url(seed: int, size=(40, 56), colour=None) -> tuple[str, Image.Image]:
    """A random RGB PNG (or one of a single ``colour``) as a data: URL, and the image."""
    pixels = (np.random.default_rng(seed).random((size[1], size[0], 3)) * 255).astype(np.uint8)
    image = Image.fromarray(pixels) if colour is None else Image.new("RGB", size, colour)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode(), image


def ask(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "what is this ?"}]}]


def jiggled(path: str, save=save_tiny_llava) -> str:
    """A tiny LLaVA (or what ``save`` writes) with noise (std 0.3) on every weight: answers that
    differ with the image, not one token over and over as at its small initial scale."""
    model_dir = save(path, WORDS, seed=3)
    model = from_pretrained(auto_class(model_dir), model_dir, scan_layers=False)  # (the noise
    # drawn per layer, as before the stacked default)
    leaves, tree = jax.tree.flatten(nnx.state(model, nnx.Param))
    rng = np.random.default_rng(0)  # (on the host: no compile per weight shape)
    nnx.update(model, jax.tree.unflatten(tree, [
        x + 0.3 * rng.standard_normal(x.shape, np.float32) for x in leaves]))
    save_pretrained(model, model_dir)
    return model_dir


def transformers_answer(model_dir: str, image: Image.Image,
                        family=transformers.LlavaForConditionalGeneration,
                        placeholder="<image>") -> str:
    """transformers' greedy reply (``N_NEW`` tokens, past any EOS) to ``ask``."""
    processor = image_processor(model_dir)  # (Qwen's: without its video processor)
    model = family.from_pretrained(model_dir).eval()
    text = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": placeholder + "\nwhat is this ?"}], tokenize=False,
        add_generation_prompt=True)
    inputs = processor(text=[text], images=[image], add_special_tokens=False,
                       return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=N_NEW, do_sample=False, eos_token_id=None,
                             pad_token_id=processor.tokenizer.pad_token_id)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:],
                                      skip_special_tokens=True)


def test_redco_serve_answers_an_image_as_transformers_does(tmp_path):
    model_dir = jiggled(str(tmp_path / "llava"))
    # one row: the requests come one at a time (fewer decode shapes to warm up)
    client = served_in_process(model_dir, "--max_images", "1", "--max_len", "96", "--max_seqs",
                               "1", "--n_model_shards", "2")
    try:
        answers = []
        for seed in (0, 2):  # two images of other sizes (40 x 56, 56 x 56)
            url, image = png_url(seed, size=(40 + 8 * seed, 56))
            reply = client.chat.completions.create(
                model="served", messages=ask(url), max_completion_tokens=N_NEW, temperature=0,
                extra_body={"ignore_eos": True})
            answers.append(reply.choices[0].message.content)
            assert answers[-1] == transformers_answer(model_dir, image)
        assert answers[0] != answers[1] and all(answers)  # (seen: "user what the", "this
        # blue a a": the image is read)
        with pytest.raises(openai.BadRequestError, match=r"the data: URL's image cannot be "
                                                         r"read .* give a PNG or JPEG"):
            client.chat.completions.create(model="served", messages=ask(
                "data:image/png;base64," + base64.b64encode(b"not a png").decode()))
    finally:
        client.engine.stop()


def answered_as_transformers(client, model_dir: str, images: list, family, placeholder: str):
    """Each ``(data: URL, image)`` of ``images`` asked of ``client`` (greedy, past the end
    token) is answered with transformers' ``family.generate`` reply, and the answers differ."""
    answers = []
    for url, image in images:
        reply = client.chat.completions.create(
            model="served", messages=ask(url), max_completion_tokens=N_NEW, temperature=0,
            extra_body={"ignore_eos": True})
        answers.append(reply.choices[0].message.content)
        assert answers[-1] == transformers_answer(model_dir, image, family, placeholder)
    assert len(set(answers)) == len(answers) and all(answers), answers


def served_in_process(model_dir: str, *flags: str) -> openai.OpenAI:
    """``redco serve``'s engine, processor and app as its command starts them (``start_engine``,
    warm-up included), in this process: the openai client reaches the app through starlette's
    test client (no server process to start). Close with ``.engine.stop()``."""
    parser = argparse.ArgumentParser()
    ServeCommand().add_arguments(parser)
    args = parser.parse_args(["--model", model_dir, *flags])
    engine, scorer, tokenizer, eos, processor = start_engine(args)
    app = build_app(engine, tokenizer, "served", eos, scorer, processor)
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", max_retries=0,
                           http_client=TestClient(app))
    client.engine = engine
    return client


def test_redco_serve_answers_gemma3s_image_as_transformers_does(tmp_path):
    """Gemma 3 (its real ``Gemma3Processor`` expanding ``<start_of_image>``; its image tokens
    seen both ways in the engine's prefill, in a sliding layer of window 3 and a global one):
    the openai client's chat with a PNG ``data:`` URL gets transformers'
    ``Gemma3ForConditionalGeneration.generate`` reply, for two images that answer apart. (The
    engine's tokens and log-probabilities for two image prompts in one prefill are checked
    against transformers in test_parity_gemma3_vision.)"""
    model_dir = jiggled(str(tmp_path / "gemma3"), save_tiny_gemma3)
    client = served_in_process(model_dir, "--max_seqs", "1", "--max_len", "32")
    try:
        answered_as_transformers(  # (its random images all answer alike: two colours)
            client, model_dir, [png_url(0, colour=colour) for colour in ((0, 0, 0), (255, 0, 0))],
            transformers.Gemma3ForConditionalGeneration, "<start_of_image>")
    finally:
        client.engine.stop()


def test_qwen_vl_answers_images_of_their_own_sizes_as_transformers_does(tmp_path):
    """A tiny Qwen2.5-VL served in this process (``served_in_process``, ``--max_image_patches
    60``): the openai client's two PNGs (24 x 32, 40 x 24: other grids, so other prompt
    lengths and M-RoPE deltas) are answered with transformers' greedy tokens; the processor
    is the command's own (``image_processor``), the chat's placeholder Qwen's vision marks; an
    image of more patches than the engine pads to is a 400 naming ``--max_image_patches``."""
    model_dir = jiggled(str(tmp_path / "qwen"), save_tiny_qwen_vl)
    client = served_in_process(model_dir, "--max_seqs", "1", "--max_len", "64",
                               "--max_image_patches", "60")  # (48 and 60 patches fit; 64 not)
    try:
        answered_as_transformers(
            client, model_dir, [png_url(0, (24, 32)), png_url(1, (40, 24))],
            transformers.Qwen2_5_VLForConditionalGeneration,
            "<|vision_start|><|image_pad|><|vision_end|>")
        with pytest.raises(openai.BadRequestError, match=r"give 64 patches; this engine pads "
                                                         r"a prompt's to 60.*--max_image_patches"):
            client.chat.completions.create(model="served", messages=ask(png_url(2, (32, 32))[0]))
    finally:
        client.engine.stop()


GEMMA4_SPECIALS = {"boi_token": "<|image>", "image_token": "<|image|>", "eoi_token": "<image|>",
                   "boa_token": "<|audio>", "eoa_token": "<audio|>", "audio_token": "<|audio|>"}


def test_gemma4s_processor_gives_the_engine_its_patches_and_places(tmp_path):
    """Gemma 4's processor as ``redco serve`` loads it (``image_processor``: its image
    processor and tokenizer alone where transformers cannot make its video processor without
    torchvision) turns a chat's PNG (44 x 30) into its soft tokens between the image marks and
    ``{"pixel_values", "image_position_ids"}`` (padded to the processor's 630 patches, places
    -1 there), which the engine's slots (``PlacedPatchSlots``) take, and refuse past
    ``--max_image_patches``. (The engine's tokens and log-probabilities for Gemma 4's images
    against transformers: test_parity_gemma4; host only here, nothing compiles.)"""
    tokenizer = chat_word_tokenizer([*WORDS, *GEMMA4_SPECIALS.values()],
                                    extra_special_tokens=GEMMA4_SPECIALS)
    tokenizer.save_pretrained(str(tmp_path))
    transformers.Gemma4ImageProcessorPil(patch_size=4, max_soft_tokens=70,
                                         pooling_kernel_size=3).save_pretrained(str(tmp_path))
    (tmp_path / "processor_config.json").write_text('{"processor_class": "Gemma4Processor"}')
    (tmp_path / "config.json").write_text('{"model_type": "gemma4"}')  # (as a model's dir)
    processor = image_processor(str(tmp_path))
    prompt, images = chat_with_images(ask(png_url(0, size=(44, 30))[0]), processor, chat_text)
    image, (boi, eoi) = processor.image_token_id, tokenizer.convert_tokens_to_ids(
        [GEMMA4_SPECIALS["boi_token"], GEMMA4_SPECIALS["eoi_token"]])
    n = prompt.count(image)
    assert prompt[prompt.index(boi):prompt.index(eoi) + 1] == [boi, *[image] * n, eoi]
    places = images["image_position_ids"]
    assert images["pixel_values"].shape == (1, 630, 48) and places.shape == (1, 630, 2)
    assert (places != -1).all(-1).sum() == 9 * n and (places[0, 9 * n:] == -1).all()
    cfg = Gemma4VisionConfig.from_hf({"image_token_id": image, "vision_config": dict(
        patch_size=4, pooling_kernel_size=3), "text_config": dict(
        TINY_FAMILIES["gemma4"], vocab_size=len(tokenizer), use_bidirectional_attention="vision")})
    PlacedPatchSlots(cfg, 1, 9 * n).check(prompt, images)
    with pytest.raises(ValueError, match=r"pads an image's to 9.*--max_image_patches"):
        PlacedPatchSlots(cfg, 1, 9).check(prompt, images)


IDEFICS3_SPECIALS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>",
                     "<global-img>", *(f"<row_{i}_col_{j}>" for i in range(1, 7)
                                       for j in range(1, 7))]


def test_idefics3s_processor_gives_the_engine_its_tiles(tmp_path):
    """Idefics3's processor as ``redco serve`` loads it (``image_processor``) turns a chat's
    PNG (90 x 40) into its split tiles and global tile (3 of 32 x 32, each ``image_seq_len``
    4 image tokens in the prompt), which the engine's slots (``TileSlots``: ``--max_images``
    counts tiles) take, and refuse past ``--max_images``, naming it. (The engine's tokens and
    log-probabilities for Idefics3's tiles against transformers: test_parity_idefics3; host
    only here, nothing compiles.)"""
    tokenizer = chat_word_tokenizer([*WORDS, *IDEFICS3_SPECIALS], extra_special_tokens={
        "image_token": "<image>", "fake_image_token": "<fake_token_around_image>",
        "global_image_token": "<global-img>", "end_of_utterance_token": "<end_of_utterance>"})
    transformers.Idefics3Processor(image_processor=transformers.Idefics3ImageProcessorPil(
        size={"longest_edge": 64}, max_image_size={"longest_edge": 32}), tokenizer=tokenizer,
        image_seq_len=4).save_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "idefics3"}')  # (as a model's dir)
    processor = image_processor(str(tmp_path))
    prompt, tiles = chat_with_images(ask(png_url(0, size=(40, 90))[0]), processor, chat_text)
    image = processor.image_token_id
    assert np.shape(tiles) == (3, 3, 32, 32) and prompt.count(image) == 3 * 4
    TileSlots((3, 3, 32, 32), image, 4).check(prompt, tiles)
    with pytest.raises(ValueError, match=r"give 3 tiles.*at most 2.*--max_images 3"):
        TileSlots((2, 3, 32, 32), image, 4).check(prompt, tiles)


def test_an_image_to_a_text_model_is_refused_naming_the_fix(tmp_path):
    """The app over a text model's engine (in this process, through starlette's test client,
    which the openai client takes as its HTTP client): the 400 comes before the engine."""
    model_dir = save_tiny_chat_model(str(tmp_path / "chat"), TEXT_WORDS)
    model = from_pretrained(auto_class(model_dir), model_dir)
    engine = Engine(model, nnx.state(model, nnx.Param), max_len=48)
    app = build_app(engine, AutoTokenizer.from_pretrained(model_dir), "chat", (1,), None)
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", max_retries=0,
                           http_client=TestClient(app))
    with pytest.raises(openai.BadRequestError, match=r"This model reads text only.*serve "
                                                     r"an image \+ text model"):
        client.chat.completions.create(model="chat", messages=ask(png_url(0)[0]))


def test_the_engine_refuses_what_it_cannot_read_of_an_image_model(tmp_path):
    model_dir = save_tiny_llava(str(tmp_path / "llava"), WORDS)
    model = from_pretrained(auto_class(model_dir), model_dir)
    with pytest.raises(ValueError, match="drop --prefill_chunk and --prefix_caching"):
        Engine(model, nnx.state(model, nnx.Param), max_len=96, prefix_caching=True)
    slots = image_slots(model, 1, None, False)
    prompt = [3, 4, *[slots.token] * 64, 7]
    with pytest.raises(ValueError, match=r"pixels are \(3, 16, 16\), not the tower's "
                                         r"\(3, 32, 32\)"):
        check_images(slots, prompt, np.zeros((1, 3, 16, 16)))
    with pytest.raises(ValueError, match=r"holds 64 image tokens \(id \d+\) for 0 images"):
        check_images(slots, prompt, None)
    with pytest.raises(ValueError, match=r"has 2 images; this engine takes at most 1 a prompt"):
        check_images(slots, prompt + prompt, np.zeros((2, 3, 32, 32)))
    with pytest.raises(ValueError, match=r"reads text only"):
        check_images(None, [3, 4], np.zeros((1, 3, 32, 32)))
