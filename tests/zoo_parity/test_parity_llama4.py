"""Llama 4 beyond the shared family tests (``test_parity_families`` runs the tiny ``llama4``
checkpoint, ``toy.TINY_FAMILIES``, through logits, left padding, greedy decoding with the KV
cache, cached log-probs and export): its logits within 1e-4 of transformers' over 40 tokens
(five chunks of 8; the NoPE layer's temperature 2.2 at the last slot), where each of its
pieces changes them, and over 520 (the tiled path); a multimodal ``llama4`` checkpoint read
as its language model; context parallelism refused before compiling."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from parity import close, jiggle_torch, torch_logits, transformers

from redco import Deployer, sequence_split
from redco_zoo_models import from_pretrained
from redco_zoo_models.hf import auto_class
from redco_zoo_models.toy import TINY_FAMILIES

EOS = 63
IDS = np.random.RandomState(40).randint(1, EOS, (2, 40))
TEXT = {k: v for k, v in TINY_FAMILIES["llama4"].items() if k != "model_type"}
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
              image_size=28, patch_size=14, vision_output_dim=16, projector_input_dim=16,
              projector_output_dim=16)


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


def test_a_multimodal_checkpoint_reads_as_its_language_model(tmp_path):
    """``Llama4ForConditionalGeneration``'s checkpoint (``language_model.*`` beside a vision
    tower and projector): its text logits."""
    torch.manual_seed(0)
    theirs = jiggle_torch(transformers.Llama4ForConditionalGeneration(transformers.Llama4Config(
        text_config=TEXT, vision_config=VISION, boi_token_index=60, eoi_token_index=61,
        image_token_index=62)))
    path = written(theirs, tmp_path)
    ours = from_pretrained(auto_class(path), path)
    np.testing.assert_allclose(forward(ours), torch_logits(theirs, input_ids=IDS), atol=1e-4)


def test_context_parallelism_is_refused(pair):
    _, ours = pair
    mesh = Deployer(jax_seed=0, n_context_shards=2, workdir=None, verbose=False).mesh
    with sequence_split.splitting(mesh), pytest.raises(ValueError, match="context parallel"):
        jax.eval_shape(lambda ids: ours(ids), jnp.asarray(IDS))
