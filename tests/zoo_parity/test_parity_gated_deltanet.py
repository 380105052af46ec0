"""Qwen3.5 (dense), Qwen3-Next and Qwen3.5-MoE (``toy.DELTA_NET_FAMILIES``: Gated DeltaNet layers
around a gated full-attention one, zero-centred norms, partial rotary; shared experts with a
sigmoid gate) against transformers' PyTorch models: logits over 150 tokens (past the delta
rule's 64-token chunk and the width-3 convolution), left-padded rows, export read back by
transformers, and greedy generation through the recurrent state.

Weights are perturbed by 0.1, not ``parity.jiggle_torch``'s 0.3: at 0.3 the gated RMSNorm of
near-cancelling delta-rule outputs amplifies float32 rounding, and transformers' own chunked
and recurrent rules (or ours at chunks of 64 and 8) then differ by ~1e-3 on the logits."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from parity import hf_greedy, left_padded, transformers

from redco_zoo_models import from_pretrained, generate, save_pretrained
from redco_zoo_models.gated_deltanet import chunked, recurrent
from redco_zoo_models.hf import auto_class
from redco_zoo_models.toy import DELTA_NET_FAMILIES, TINY_FAMILIES

EOS, PAD, ATOL = 63, 0, 1e-4


def make_pair(family: str, path: str, decay: float | None = None):
    """transformers' tiny ``family`` (weights perturbed by 0.1; with ``decay``, every
    ``A_log`` set to ``log(decay)``) and ours read from the checkpoint it saves at ``path``."""
    config = dict(TINY_FAMILIES[family])
    config = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            p.add_(0.1 * torch.randn_like(p))
            if decay is not None and name.endswith("A_log"):
                p.fill_(np.log(decay))
    theirs.eval().save_pretrained(path)
    return theirs, from_pretrained(auto_class(path), path)


@pytest.fixture(scope="module", params=DELTA_NET_FAMILIES)
def pair(request, tmp_path_factory):
    return make_pair(request.param, str(tmp_path_factory.mktemp(request.param)))


def torch_logits(model, ids, **inputs):
    with torch.no_grad():
        return model(torch.tensor(ids), use_cache=False,
                     **{k: torch.tensor(v) for k, v in inputs.items()}).logits.numpy()


def jitted(model):
    graphdef, state = nnx.split(model)
    run = jax.jit(lambda state, ids, mask: nnx.merge(graphdef, state)(ids, attention_mask=mask))
    return lambda ids, attention_mask=None: np.asarray(run(state, jnp.asarray(ids),
                                                           attention_mask))


def test_logits_past_a_chunk_equal_transformers_within_1e4(pair):
    """150 tokens: three of transformers' 64-token chunks; ours at chunks of 64 (and, for
    Qwen3.5, of 16)."""
    theirs, ours = pair
    ids = np.random.RandomState(0).randint(1, EOS, (2, 150))
    want = torch_logits(theirs, ids)
    np.testing.assert_allclose(jitted(ours)(ids), want, atol=ATOL)
    if ours.cfg.family == "qwen3_5_text":
        small = type(ours)(dataclasses.replace(ours.cfg, delta_chunk_size=16), nnx.Rngs(0))
        nnx.update(small, nnx.state(ours, nnx.Param))
        np.testing.assert_allclose(jitted(small)(ids), want, atol=ATOL)


def only_qwen35_in_ci():
    """``pair``'s families, Qwen3-Next and Qwen3.5-MoE marked slow: their recurrent layers are
    Qwen3.5's (what differs, their MoE blocks, is in every test of their logits)."""
    return ["qwen3.5", *(pytest.param(f, marks=pytest.mark.slow)
                         for f in DELTA_NET_FAMILIES if f != "qwen3.5")]


@pytest.mark.parametrize("pair", only_qwen35_in_ci(), indirect=True)
def test_left_padded_logits_equal_transformers(pair):
    """Qwen3-Next's and Qwen3.5-MoE's cases are slow-tier repeats: in CI the padding of the
    delta rule's layers is guarded by the qwen3.5 case, their own layers by
    test_logits_past_a_chunk_equal_transformers_within_1e4."""
    theirs, ours = pair
    ids, mask = left_padded(3, 20, EOS, PAD, seed=3)
    got = jitted(ours)(ids, attention_mask=jnp.asarray(mask))
    want = torch_logits(theirs, ids, attention_mask=mask)
    np.testing.assert_allclose(got * mask[..., None], want * mask[..., None], atol=ATOL)


def test_packed_documents_each_give_transformers_logits_alone(tmp_path):
    """Qwen3.5 with a slow decay (``A = 0.05``: a state remembers tens of tokens, so one that
    leaks over a boundary shows). Documents of 12, 20 and 41 tokens and 7 pads in a row of 80,
    read in chunks of 64 and of 16 (boundaries inside chunks, a document over three): each
    document's logits are transformers' for it alone."""
    theirs, ours = make_pair("qwen3.5", str(tmp_path), decay=0.05)
    bounds = ((0, 12), (12, 32), (32, 73))
    ids = np.random.RandomState(5).randint(1, EOS, (1, 80))
    segments = np.zeros((1, 80), np.int32)
    for i, (start, stop) in enumerate(bounds):
        segments[:, start:stop] = i + 1
    small = type(ours)(dataclasses.replace(ours.cfg, delta_chunk_size=16), nnx.Rngs(0))
    nnx.update(small, nnx.state(ours, nnx.Param))
    for model in (ours, small):
        graphdef, state = nnx.split(model)
        packed = np.asarray(jax.jit(lambda state, ids, segments: nnx.merge(graphdef, state)(
            ids, segment_ids=segments))(state, jnp.asarray(ids), jnp.asarray(segments)))
        for start, stop in bounds:
            np.testing.assert_allclose(packed[:, start:stop],
                                       torch_logits(theirs, ids[:, start:stop]), atol=ATOL,
                                       err_msg=f"document {start}:{stop}")


def test_export_loads_in_transformers_with_the_same_logits(pair, tmp_path):
    theirs, ours = pair
    save_pretrained(ours, str(tmp_path))
    back, info = type(theirs).from_pretrained(str(tmp_path), output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ids = np.random.RandomState(6).randint(1, EOS, (2, 40))
    np.testing.assert_allclose(torch_logits(back.eval(), ids), torch_logits(theirs, ids),
                               atol=1e-6)


@pytest.mark.parametrize("pair", only_qwen35_in_ci(), indirect=True)
def test_greedy_generation_equals_transformers(pair):
    """Prompts behind 0-3 pads, 16 new tokens: the conv and delta-rule states carried per row.
    Qwen3-Next's and Qwen3.5-MoE's cases are slow-tier repeats: in CI the states are guarded by
    the qwen3.5 case, their MoE blocks by test_logits_past_a_chunk_equal_transformers_within_1e4
    (and decoding over experts by test_parity_families' deepseek-v3 and gpt-oss cases)."""
    theirs, ours = pair
    if ours.cfg.family == "qwen3_5_moe_text":
        pytest.skip("Qwen3.5 and Qwen3-Next cover its layers")
    prompts, mask = left_padded(4, 6, EOS, PAD, seed=4)
    got = jax.jit(lambda params, prompts, mask: generate(
        ours, params, prompts, 16, prompt_mask=mask, eos_token_id=EOS, pad_token_id=PAD))(
        nnx.state(ours, nnx.Param), jnp.asarray(prompts), jnp.asarray(mask))
    want = hf_greedy(theirs, prompts, 6, 16, EOS, PAD, attention_mask=mask)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_the_chunked_rule_equals_the_recurrence():
    """The chunked delta rule (chunks of 8 over 37 tokens, from a given state) equals the plain
    recurrence, output and final state, to 1e-5; value heads twice the key heads."""
    r = np.random.RandomState(0)
    q, k = r.randn(2, 2, 37, 2, 8).astype(np.float32)
    v = r.randn(2, 37, 4, 6).astype(np.float32)
    g = -np.abs(r.randn(2, 37, 4)).astype(np.float32)
    beta = 1 / (1 + np.exp(-r.randn(2, 37, 4))).astype(np.float32)
    state = r.randn(2, 4, 8, 6).astype(np.float32)
    for got, want in zip(chunked(q, k, v, g, beta, 8, state), recurrent(q, k, v, g, beta, state)):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_the_language_model_of_a_multimodal_checkpoint_reads_alone(tmp_path):
    """A tiny Qwen3.5 vision-language checkpoint (``qwen3_5``: the text config nested, the
    language model under ``model.language_model``, a vision tower beside it) read as its causal
    LM: the logits of transformers' multimodal model given text alone."""
    text = {k: v for k, v in TINY_FAMILIES["qwen3.5"].items() if k != "model_type"}
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                  patch_size=4, spatial_merge_size=2, num_position_embeddings=16)
    torch.manual_seed(0)
    theirs = transformers.Qwen3_5ForConditionalGeneration(transformers.Qwen3_5Config(
        text_config=text, vision_config=vision))
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(0.1 * torch.randn_like(p))
    theirs.eval().save_pretrained(str(tmp_path))
    ours = from_pretrained(auto_class(str(tmp_path)), str(tmp_path))
    ids = np.random.RandomState(7).randint(1, EOS, (2, 30))
    np.testing.assert_allclose(jitted(ours)(ids), torch_logits(theirs, ids), atol=ATOL)
