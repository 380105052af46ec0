"""Llama 4 beyond the shared family tests (``test_parity_families`` runs the tiny ``llama4``
checkpoint, ``toy.TINY_FAMILIES``, through logits, left padding, greedy decoding with the KV
cache, cached log-probs and export): its logits within 1e-4 of transformers' over 40 tokens
(five chunks of 8; the NoPE layer's temperature 2.2 at the last slot), where each of its
pieces changes them, and over 520 (the tiled path); a multimodal ``llama4`` checkpoint read
as its language model, and with its images (``llama4_vision``); context parallelism refused
before compiling."""
import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from parity import close, hf_greedy, jiggle_torch, load_hf, torch_logits, transformers

from redco import Deployer, sequence_split
from redco_zoo_models import from_pretrained, save_pretrained
from redco_zoo_models.engine import Engine
from redco_zoo_models.generation import generate
from redco_zoo_models.hf import auto_class
from redco_zoo_models.llama4_vision import Llama4ForConditionalGeneration
from redco_zoo_models.llama4_vision_config import Llama4TowerConfig
from redco_zoo_models.toy import TINY_FAMILIES

EOS = 63
IDS = np.random.RandomState(40).randint(1, EOS, (2, 40))
TEXT = {k: v for k, v in TINY_FAMILIES["llama4"].items() if k != "model_type"}
# the tower: 4 x 4 patches of 7 pixels a tile, pixel-shuffled to 2 x 2 tokens of 64 features
VISION = dict(hidden_size=16, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              image_size=28, patch_size=7, vision_output_dim=24, projector_input_dim=24,
              projector_output_dim=24)
WORDS = {"<s>": 1, "a": 5, "b": 6, "c": 7, "d": 8, "<|image_start|>": 60, "<|image_end|>": 61,
         "<|patch|>": 62, "<|image|>": 57, "<|tile_x_separator|>": 58, "<|tile_y_separator|>": 59}


def forward(model, ids=IDS):
    """``model``'s logits of ``ids``, compiled."""
    graphdef, state = nnx.split(model)
    return np.asarray(jax.jit(lambda state: nnx.merge(graphdef, state)(jnp.asarray(ids)))(state))


def written(model, path) -> str:
    model.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """``(transformers' Llama4ForCausalLM, ours read from its checkpoint)``."""
    torch.manual_seed(0)
    theirs = jiggle_torch(transformers.AutoModelForCausalLM.from_config(
        transformers.Llama4TextConfig(**TEXT)))
    path = written(theirs, tmp_path_factory.mktemp("llama4"))
    return theirs, from_pretrained(auto_class(path), path)


def test_logits_are_within_1e4_where_each_of_its_pieces_matters(pair):
    """Without the chunk mask, the NoPE layer's temperature tuning, the router's weight on the
    experts' inputs (on their outputs instead), the L2 q/k norm or RoPE's complex pairs (halves
    instead) the logits differ."""
    theirs, ours = pair
    want = forward(ours)
    np.testing.assert_allclose(want, torch_logits(theirs, input_ids=IDS), atol=1e-4)
    params = nnx.state(ours, nnx.Param)
    for change in (dict(chunked_layers=()), dict(attn_temperature_tuning=False),
                   dict(expert_input_scaled=False), dict(qk_norm=None),
                   dict(rope_interleave=False)):
        other = type(ours)(dataclasses.replace(ours.cfg, **change), nnx.Rngs(0))
        nnx.update(other, params)
        assert np.abs(forward(other) - want).max() > 1e-2, change


def test_past_one_tile_of_keys_the_tiled_chunks_give_transformers_logits(pair):
    """520 tokens, past the 512 keys of a tile: the chunked layers' plain causal attention runs
    tiled (``attention.attend``, a chunk a segment), with transformers' logits up to
    ``parity.close``: the two sides' ``llama3`` inverse frequencies differ by an ulp (1e-7),
    which turns RoPE's angles at position ~500 by ~3e-5 (logits 2e-4 apart, each side's masked
    and tiled paths 2e-5)."""
    theirs, ours = pair
    ids = np.random.RandomState(520).randint(1, EOS, (1, 520))
    close(forward(ours, ids), torch_logits(theirs, input_ids=ids))


def test_with_images_logits_tokens_and_export_match_transformers(tmp_path, capsys):
    """``Llama4ForConditionalGeneration``'s tiny checkpoint read as its language model
    (``language_model.*`` beside the tower and projector): its text logits. Read with
    ``images`` (``llama4_vision``): on a 1 x 2 tiled image (two tiles and the global one) and a
    one-tile image, laid out as Llama4Processor lays them out, the tower's tokens to 1e-5 of
    their scale, fp32 logits within 1e-4, greedy tokens equal, an export transformers loads
    back; the serving engine and SFT refuse it before compiling, naming the tiles."""
    torch.manual_seed(0)
    theirs = jiggle_torch(transformers.Llama4ForConditionalGeneration(transformers.Llama4Config(
        text_config=TEXT, vision_config=VISION, boi_token_index=60, eoi_token_index=61,
        image_token_index=62)))
    path = written(theirs, tmp_path / "theirs")
    text = from_pretrained(auto_class(path), path)
    np.testing.assert_allclose(forward(text), torch_logits(theirs, input_ids=IDS), atol=1e-4)
    ours = from_pretrained(auto_class(path, images=True), path)
    assert isinstance(ours, Llama4ForConditionalGeneration)
    batch = image_batch()
    graphdef, state = nnx.split(ours)
    got = np.asarray(jax.jit(lambda s, *a: nnx.merge(graphdef, s)(*a))(
        state, batch["input_ids"], batch["attention_mask"], batch["pixel_values"]))
    valid = batch["attention_mask"] > 0
    np.testing.assert_allclose(got[valid], torch_logits(theirs, **batch)[valid], atol=1e-4)
    with torch.no_grad():
        want = theirs.vision_model(torch.tensor(batch["pixel_values"])).last_hidden_state.numpy()
    stacked = np.asarray(ours.vision_model(jnp.asarray(batch["pixel_values"])))
    assert ours.vision_model.model.runs is not None  # (stacked and scanned: scan_layers)
    assert np.abs(stacked - want).max() <= 1e-5 * np.abs(want).max()
    unrolled = from_pretrained(auto_class(path, images=True), path, scan_layers=False)
    tokens = np.asarray(unrolled.vision_model(jnp.asarray(batch["pixel_values"])))
    assert unrolled.vision_model.model.runs is None
    assert np.abs(tokens - want).max() <= 1e-5 * np.abs(want).max()
    check_greedy(ours, theirs, batch)
    save_pretrained(ours, str(tmp_path / "ours"))
    back = load_hf(transformers.Llama4ForConditionalGeneration, tmp_path / "ours")
    np.testing.assert_allclose(got[valid], torch_logits(back, **batch)[valid], atol=1e-4)
    with pytest.raises(NotImplementedError, match="does not cut images into Llama 4's tiles"):
        Engine(ours, nnx.state(ours, nnx.Param), max_len=64)
    assert "does not cut images into Llama 4's tiles" in ours.untrained()
    check_sft_refuses_images(str(tmp_path / "ours"), tmp_path, capsys)
    with pytest.raises(ValueError, match="fc1 reads intermediate_size 48 features, the pixel "
                                         "shuffle gives 64"):
        Llama4TowerConfig.from_hf({**VISION, "intermediate_size": 48})


def image_batch() -> dict:
    """Two left-padded rows: a 1 x 2 tiled image (3 tiles) and a one-tile image, their tokens
    as transformers' Llama4Processor writes them (4 ``<|patch|>`` a tile: 4 x 4 patches
    shuffled 2 x 2); the tiles' pixels drawn here (Llama4ImageProcessor needs torchvision,
    which the environment does not carry)."""
    layout = transformers.Llama4Processor._prompt_split_image  # (uses no processor state)
    rows = [["<s>", "a", "b", layout(None, (1, 2), 4), "c"], ["<s>", layout(None, (1, 1), 4), "d"]]
    ids = [[WORDS[t] for part in row for t in re.findall(r"<\|\w+\|>|\S+", part)]
           for row in rows]
    width = max(map(len, ids))
    return {"input_ids": np.array([[0] * (width - len(r)) + r for r in ids]),
            "attention_mask": np.array([[0] * (width - len(r)) + [1] * len(r) for r in ids]),
            "pixel_values": np.random.RandomState(4).randn(4, 3, 28, 28).astype(np.float32)}


def check_sft_refuses_images(model_dir: str, tmp_path, capsys):
    """``redco zoo run sft`` reads the checkpoint as its language model: chats holding an image
    part are refused after loading, before compiling (GRPO's ``image_prompts.check_model``
    refuses a text model too; ``redco serve`` answers an image part to one with a 400)."""
    from PIL import Image

    from redco.cli import main
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    user = {"role": "user", "content": [{"type": "image", "path": str(tmp_path / "a.png")},
                                        {"type": "text", "text": "a"}]}
    (tmp_path / "chats.jsonl").write_text(json.dumps({"messages": [
        user, {"role": "assistant", "content": "b"}]}) + "\n")
    with pytest.raises(SystemExit):
        main(["zoo", "run", "sft", "--model", model_dir, "--workdir", str(tmp_path / "sft"),
              "--train", str(tmp_path / "chats.jsonl")])
    err = capsys.readouterr().err
    assert "read as a text model (DecoderLM) and the chats hold image parts" in err, err


def check_greedy(ours, theirs, batch):
    ids, mask, pixels = batch["input_ids"], batch["attention_mask"], batch["pixel_values"]
    got = jax.jit(lambda params, ids, mask, pixels: generate(
        ours, params, ids, 6, prompt_mask=mask, eos_token_id=EOS, pad_token_id=0,
        encoder_inputs={"pixel_values": pixels}))(nnx.state(ours, nnx.Param), ids, mask, pixels)
    want = hf_greedy(theirs, ids, ids.shape[1], 6, EOS, 0, attention_mask=mask,
                     pixel_values=pixels)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_context_parallelism_is_refused(pair):
    _, ours = pair
    mesh = Deployer(jax_seed=0, n_context_shards=2, workdir=None, verbose=False).mesh
    with sequence_split.splitting(mesh), pytest.raises(ValueError, match="context parallel"):
        jax.eval_shape(lambda ids: ours(ids), jnp.asarray(IDS))
