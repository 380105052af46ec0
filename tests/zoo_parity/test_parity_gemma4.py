"""Gemma 4 beyond the shared suite (test_parity_families' ``gemma4``: per-layer inputs, KV
sharing, proportional RoPE, full layers of their own head size, the MoE block beside every
MLP): full layers whose values are their keys' projection (``attention_k_eq_v``) with their
own key/value heads, the 26B-A4B's layout (the MoE block, no per-layer inputs or sharing) with
its layers stacked, against transformers' ``Gemma4ForCausalLM``; and what is refused before
compiling. Gemma 4 with images (``Gemma4ForConditionalGeneration``'s vision tower: patches of
any aspect padded, 2-D RoPE, pooling, the projector) on its image processor's output, and the
serving engine reading two image prompts of other sizes in one prefill."""
import json

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from parity import (
    close,
    engine_reads_in_one_prefill,
    hf_greedy,
    jiggle_torch,
    load_hf,
    logprobs_match,
    transformers,
)
from PIL import Image
from test_parity_families import ATOL, FAMILIES, jitted, random_buffers, torch_logits

from redco.tree_paths import named_leaves
from redco_zoo_models import from_pretrained, save_pretrained
from redco_zoo_models.decoder_config import DecoderConfig
from redco_zoo_models.engine import Engine
from redco_zoo_models.gemma4_vision import Gemma4ForConditionalGeneration
from redco_zoo_models.gemma4_vision_config import Gemma4VisionConfig
from redco_zoo_models.generation import generate
from redco_zoo_models.hf import auto_class
from redco_zoo_models.requests import Sampling
from redco_zoo_models.toy import TINY_FAMILIES

K_EQ_V = dict(TINY_FAMILIES["gemma4"], attention_k_eq_v=True, num_global_key_value_heads=1)
PLAIN = dict(FAMILIES["gemma4"], hidden_size_per_layer_input=0, num_kv_shared_layers=0,
             use_double_wide_mlp=False, layer_types=[
                 "sliding_attention", "sliding_attention", "full_attention",
                 "sliding_attention", "full_attention"])  # (no per-layer inputs, no sharing;
#                                                           the MoE block beside each MLP)


def saved(config: dict, path, seed: int):
    """transformers' model of ``config`` (weights and layer scalars perturbed), saved in
    ``path``."""
    config = dict(config)
    config = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
    torch.manual_seed(seed)
    theirs = random_buffers(jiggle_torch(transformers.AutoModelForCausalLM.from_config(config)))
    theirs.save_pretrained(str(path))
    return theirs


def test_keys_as_values_logits_equal_transformers(tmp_path):
    """40 tokens (past the window of 8), full layers with one key/value head whose values are
    the keys' projection (no ``v_proj``): transformers' logits."""
    theirs = saved(K_EQ_V, tmp_path, seed=1)
    assert theirs.model.layers[1].self_attn.v_proj is None  # (keys as values there)
    ours = from_pretrained(auto_class(str(tmp_path)), str(tmp_path))
    ids = np.random.RandomState(40).randint(1, 63, (2, 40))
    close(jitted(ours)(ids), torch_logits(theirs, ids), ATOL["gemma4"])


def test_scanned_layers_without_sharing_read_and_write_transformers_checkpoints(tmp_path):
    """Without per-layer inputs or KV sharing (the 26B-A4B's layout: the 31B's with the MoE
    block), the layers stacked in runs of like layers (sliding ones of one head size, full
    ones of another; each one's MLP, router, experts and their norms stacked) give
    transformers' logits, and written back, transformers reads them whole."""
    theirs = saved(PLAIN, tmp_path / "in", seed=3)
    ours = from_pretrained(auto_class(str(tmp_path / "in")), str(tmp_path / "in"),
                           scan_layers=True)
    assert any(":" in p and "/moe/experts/" in p
               for p, _ in named_leaves(nnx.state(ours, nnx.Param)))
    ids = np.random.RandomState(42).randint(1, 63, (2, 40))
    want = torch_logits(theirs, ids)
    close(jitted(ours)(ids), want, ATOL["gemma4"])
    save_pretrained(ours, str(tmp_path / "out"))
    back = load_hf(type(theirs), str(tmp_path / "out"))
    close(torch_logits(back, ids), want, ATOL["gemma4"])


@pytest.mark.parametrize("change, named", [
    (dict(enable_moe_block=True, num_experts=4, moe_intermediate_size=8), "top_k_experts"),
    (dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
    (dict(num_kv_shared_layers=5), "num_kv_shared_layers"),
])
def test_what_gemma4_does_not_run_is_refused_naming_it(change, named):
    with pytest.raises(ValueError, match=named):
        DecoderConfig.from_hf(dict(TINY_FAMILIES["gemma4"], **change))


def test_stacked_layers_with_kv_sharing_are_refused_before_building():
    cfg = DecoderConfig.from_hf(TINY_FAMILIES["gemma4"])
    with pytest.raises(ValueError, match="scan_layers"):
        DecoderConfig(**{**cfg.__dict__, "scan_layers": True})


def test_the_multimodal_checkpoints_text_part_gives_transformers_logits(tmp_path):
    """A ``gemma4`` checkpoint (``Gemma4ForConditionalGeneration``: a tiny vision tower beside
    the language model, ``model.language_model.*``, its layers' routers and experts too) read
    as its language model: the logits of transformers' whole model on text alone."""
    text = {k: v for k, v in FAMILIES["gemma4"].items() if k != "model_type"}
    config = transformers.Gemma4Config(text_config=text, audio_config=None, vision_config=dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=8, patch_size=4, position_embedding_size=64))
    torch.manual_seed(2)
    theirs = random_buffers(jiggle_torch(transformers.Gemma4ForConditionalGeneration(config)))
    theirs.save_pretrained(str(tmp_path))
    ours = from_pretrained(auto_class(str(tmp_path)), str(tmp_path))
    ids = np.random.RandomState(41).randint(1, 63, (2, 40))
    with torch.no_grad():
        want = theirs(input_ids=torch.tensor(ids)).logits.numpy()
    close(jitted(ours)(ids), want, ATOL["gemma4"])


IMAGE, BOI, EOI = 60, 58, 59
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=8, patch_size=4, position_embedding_size=64,
              pooling_kernel_size=3, standardize=True, use_clipped_linears=True)


def image_batch() -> dict:
    """Two left-padded rows, one image each (24 x 40 and 36 x 20 pixels: 60 and 66 soft tokens
    of the processor's 70, so the patches are padded), as Gemma 4's image processor makes them;
    ``mm_token_type_ids`` 1 at the image tokens."""
    rng = np.random.RandomState(3)
    images = [Image.fromarray((rng.rand(h, w, 3) * 255).astype(np.uint8))
              for h, w in ((24, 40), (36, 20))]
    out = transformers.Gemma4ImageProcessorPil(patch_size=4, max_soft_tokens=70,
                                               pooling_kernel_size=3)(images, return_tensors="np")
    n = out["num_soft_tokens_per_image"]
    rows = [[2, 5, BOI, *[IMAGE] * n[0], EOI, 7, 9], [BOI, *[IMAGE] * n[1], EOI, 4]]
    width = max(map(len, rows))
    ids = np.array([[0] * (width - len(r)) + r for r in rows])
    return {"input_ids": ids, "attention_mask": (np.arange(width) >= width - np.array(
        [len(r) for r in rows])[:, None]).astype(np.int64), "pixel_values": out["pixel_values"],
        "image_position_ids": out["image_position_ids"], "mm_token_type_ids": (ids == IMAGE) * 1}


def gemma4_with_images():
    """transformers' tiny Gemma 4 with a vision tower (clipped linears and standardised soft
    tokens, their bounds and scales drawn here), image tokens both ways in sliding layers."""
    text = dict({k: v for k, v in FAMILIES["gemma4"].items() if k != "model_type"},
                max_position_embeddings=256, use_bidirectional_attention="vision")
    config = transformers.Gemma4Config(text_config=text, audio_config=None, vision_config=VISION,
                                       image_token_id=IMAGE, boi_token_id=BOI, eoi_token_id=EOI)
    torch.manual_seed(5)
    theirs = random_buffers(jiggle_torch(transformers.Gemma4ForConditionalGeneration(config)))
    with torch.no_grad():
        for name, buffer in theirs.named_buffers():
            if name.endswith(("_min", "_max")):
                buffer.fill_((1.0 if name.endswith("_max") else -1.0) * (2 + torch.rand(()).item()))
            elif name.endswith(("std_bias", "std_scale")):
                buffer.copy_(torch.randn_like(buffer) * 0.3 + name.endswith("std_scale"))
    return theirs


def test_gemma4_with_images_logits_greedy_tokens_and_export_match_transformers(tmp_path):
    """Gemma 4's tower (padded patches of two aspects, 2-D RoPE, q/k/v norms, clipped linears,
    k x k pooling, standardisation) and projector on its image processor's output, the soft
    tokens placed in order, image tokens both ways in the sliding layers only, per-layer inputs
    of the pad token at them: fp32 logits (``ATOL``), the soft tokens to 1e-5 of their scale,
    greedy tokens, an export transformers loads back, the serving engine's tokens and
    log-probabilities (``check_engine``); ``auto_class`` without ``images`` reads the language
    model. (SFT's loss on its image chats: test_parity_gemma4_sft.)"""
    batch, theirs = image_batch(), gemma4_with_images()
    theirs.save_pretrained(str(tmp_path / "theirs"))
    assert auto_class(str(tmp_path / "theirs")).__name__ == "DecoderLM"
    ours = from_pretrained(auto_class(str(tmp_path / "theirs"), images=True),
                           str(tmp_path / "theirs"))
    assert isinstance(ours, Gemma4ForConditionalGeneration) and ours.bidirectional_images
    graphdef, state = nnx.split(ours)
    forward = jax.jit(lambda state, *a: nnx.merge(graphdef, state)(*a))
    inputs = [batch[k] for k in ("input_ids", "attention_mask", "pixel_values",
                                 "image_position_ids")]
    ours.check_tokens(batch["input_ids"], batch["image_position_ids"])
    valid = batch["attention_mask"] > 0
    got = np.asarray(forward(state, *inputs))[valid]
    close(got, torch_logits_of(theirs, batch)[valid], ATOL["gemma4"])
    with torch.no_grad():
        want = torch.cat(theirs.get_image_features(
            torch.tensor(batch["pixel_values"]),
            torch.tensor(batch["image_position_ids"])).pooler_output).numpy()
    features = np.asarray(ours.encode(batch["pixel_values"], batch["image_position_ids"]))
    assert np.abs(features[:len(want)] - want).max() <= 1e-5 * np.abs(want).max()
    scanned = nnx.clone(ours)  # (the tower's layers stacked and scanned; its text model's
    scanned.vision_tower.stack_blocks()  # per-layer inputs refuse scan_layers: gemma4.py)
    assert scanned.vision_tower.runs[0].repeats == 2
    features = np.asarray(scanned.encode(batch["pixel_values"], batch["image_position_ids"]))
    assert np.abs(features[:len(want)] - want).max() <= 1e-5 * np.abs(want).max()
    check_engine(ours, theirs, batch, check_images_greedy(ours, theirs, batch))
    save_pretrained(ours, str(tmp_path / "ours"))
    back = load_hf(transformers.Gemma4ForConditionalGeneration, tmp_path / "ours")
    close(got, torch_logits_of(back, batch)[valid], ATOL["gemma4"])
    check_refusals(json.loads((tmp_path / "theirs" / "config.json").read_text()))


def check_refusals(config: dict):
    """An audio tower, and a text config whose every token sees both ways, are refused."""
    with pytest.raises(ValueError, match="not audio yet"):
        Gemma4VisionConfig.from_hf({**config, "audio_config": {"hidden_size": 8}})
    with pytest.raises(ValueError, match="use_bidirectional_attention 'all'"):
        Gemma4VisionConfig.from_hf({**config, "text_config": {
            **config["text_config"], "use_bidirectional_attention": "all"}})


def torch_logits_of(model, batch):
    with torch.no_grad():
        return model(**{k: torch.tensor(v) for k, v in batch.items()}).logits.numpy()


def check_images_greedy(ours, theirs, batch):
    ids, mask = batch["input_ids"], batch["attention_mask"]
    got = jax.jit(lambda params, ids, mask, pixels, places: generate(
        ours, params, ids, 6, prompt_mask=mask, eos_token_id=63, pad_token_id=0,
        encoder_inputs={"pixel_values": pixels, "image_position_ids": places}))(
        nnx.state(ours, nnx.Param), ids, mask, batch["pixel_values"], batch["image_position_ids"])
    want = hf_greedy(theirs, ids, ids.shape[1], 6, 63, 0, attention_mask=mask,
                     **{k: batch[k] for k in ("pixel_values", "image_position_ids",
                                              "mm_token_type_ids")})
    np.testing.assert_array_equal(np.asarray(got), want)
    return want


def check_engine(ours, theirs, batch, want):
    """The serving engine reads both prompts (60 and 66 soft tokens; padding dropped, the
    shorter right-padded) in one prefill, each image's own patches re-padded from the
    processor's 630 to the engine's 594 (``max_image_patches``), its image tokens both ways in
    the sliding layers of its row only: transformers' greedy tokens (``want``), and each token's
    log-probability transformers' forward ``log_softmax`` to 1e-4; an image of more patches
    is refused naming ``--max_image_patches``."""
    valid = batch["attention_mask"] > 0
    prompts = [[int(t) for t in row[m]] for row, m in zip(batch["input_ids"], valid)]
    images = [{k: batch[k][i:i + 1] for k in ("pixel_values", "image_position_ids")}
              for i in range(2)]
    engine = Engine(ours, nnx.state(ours, nnx.Param), max_seqs=2, max_len=80,
                    eos_token_ids=(63,), steps_per_sync=8, max_image_patches=594)
    samples, full, valid = engine_reads_in_one_prefill(engine, prompts, images, want)
    logprobs = torch.log_softmax(torch.tensor(torch_logits_of(theirs, {
        "input_ids": full, "attention_mask": valid * 1, "mm_token_type_ids": (full == IMAGE) * 1,
        **{k: batch[k] for k in ("pixel_values", "image_position_ids")}})), -1).numpy()
    logprobs_match(prompts, samples, logprobs)
    whole = {k: v.copy() for k, v in images[1].items()}
    whole["image_position_ids"][:] = np.maximum(whole["image_position_ids"], 0)  # (630 own)
    with pytest.raises(ValueError, match=r"pads an image's to 594.*--max_image_patches"):
        engine.submit(prompts[1], Sampling(max_tokens=1), images=whole)
