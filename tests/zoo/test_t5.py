"""The zoo's T5 without PyTorch: cached generation against re-running the decoder, padding,
relative position buckets, HuggingFace checkpoint names and a round trip, training gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from rerun import greedy_without_cache
from safetensors.numpy import load_file

from redco_zoo_models.generation import generate
from redco_zoo_models.hf import from_pretrained, save_pretrained
from redco_zoo_models.nnx_utils import split_model
from redco_zoo_models.t5 import T5Config, T5ForConditionalGeneration, relative_buckets

SHAPE = dict(vocab_size=40, d_model=32, d_kv=6, d_ff=48, num_layers=2, num_decoder_layers=3,
             num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16)
CONFIGS = {"t5": T5Config(**SHAPE),
           "flan": T5Config(**SHAPE, feed_forward_proj="gated-gelu", tie_word_embeddings=False)}


def model_and_params(kind, seed=0):
    model = T5ForConditionalGeneration(CONFIGS[kind], nnx.Rngs(seed))
    return model, nnx.state(model, nnx.Param)


def source(seed=1):
    ids = jax.random.randint(jax.random.PRNGKey(seed), (3, 7), 2, SHAPE["vocab_size"])
    mask = jnp.array([[1] * 7, [1] * 4 + [0] * 3, [0] * 2 + [1] * 5])
    return ids, mask


@pytest.mark.parametrize("kind", CONFIGS)
def test_cached_greedy_equals_rerunning_the_decoder(kind):
    model, params = model_and_params(kind)
    ids, mask = source()
    got = jax.jit(lambda p, i, m: generate(model, p, jnp.zeros((3, 1), jnp.int32), 6,
                                           encoder_inputs={"input_ids": i, "attention_mask": m})
                  )(params, ids, mask)
    start = jnp.zeros((3, 1), jnp.int32)
    np.testing.assert_array_equal(got, greedy_without_cache(lambda dec: model(ids, mask, dec),
                                                            start, 6))


def test_padding_changes_nothing():
    apply_fn, params = split_model(model_and_params("flan")[0])
    run = jax.jit(apply_fn)  # (compiled: an eager forward compiles each op)
    ids, _ = source()
    dec = jnp.array([[0, 5, 9, 3]])
    alone = run(params, ids[:1, :4], None, dec)
    padded_source = jnp.concatenate([jnp.array([[7, 7]]), ids[:1, :4], jnp.array([[7]])], 1)
    got = run(params, padded_source, jnp.array([[0, 0, 1, 1, 1, 1, 0]]), dec,
              jnp.array([[1, 1, 1, 0]]))  # and the decoder's right padding
    # (left padding shifts the real tokens' slots alike: their relative positions stay)
    np.testing.assert_allclose(got[0, :3], alone[0, :3], atol=1e-5)


def sequence_logprob(model, ids, mask, tokens):
    dec = jnp.concatenate([jnp.zeros((ids.shape[0], 1), tokens.dtype), tokens[:, :-1]], 1)
    logprobs = jax.nn.log_softmax(model(ids, mask, dec), -1)
    return jnp.take_along_axis(logprobs, tokens[..., None], -1).sum((1, 2))


@pytest.mark.slow  # REDCO_SLOW_TESTS=1: _beam_search: test_generation.py; the cache: cached greedy
def test_beam_search_is_at_least_as_likely_as_greedy():
    model, params = model_and_params("t5", seed=2)
    ids, mask = source(3)
    kwargs = dict(encoder_inputs={"input_ids": ids, "attention_mask": mask})
    start = jnp.zeros((3, 1), jnp.int32)
    greedy = generate(model, params, start, 6, **kwargs)
    beams = generate(model, params, start, 6, num_beams=3, **kwargs)
    assert (sequence_logprob(model, ids, mask, beams)
            >= sequence_logprob(model, ids, mask, greedy) - 1e-5).all()


def test_relative_buckets_follow_mesh_tensorflow():
    """Expected values from transformers' ``T5Attention._relative_position_bucket``."""
    rel = jnp.array([0, -1, 1, -7, 7, -8, 8, -15, 15, -16, 16, -100, 100, -200, 200])
    expected = {(True, 32, 128): [0, 1, 17, 7, 23, 8, 24, 9, 25, 10, 26, 15, 31, 15, 31],
                (False, 32, 128): [0, 1, 0, 7, 0, 8, 0, 15, 0, 16, 0, 30, 0, 31, 0],
                (True, 8, 16): [0, 1, 5, 3, 7, 3, 7, 3, 7, 3, 7, 3, 7, 3, 7],
                (False, 8, 16): [0, 1, 0, 5, 0, 6, 0, 7, 0, 7, 0, 7, 0, 7, 0]}
    for args, buckets in expected.items():
        np.testing.assert_array_equal(relative_buckets(rel, *args), buckets)


@pytest.mark.parametrize("kind", CONFIGS)
def test_checkpoint_round_trip_with_huggingface_names(kind, tmp_path):
    model, _ = model_and_params(kind)
    save_pretrained(model, str(tmp_path))
    names = set(load_file(tmp_path / "model.safetensors"))
    assert {"shared.weight", "encoder.final_layer_norm.weight", "decoder.final_layer_norm.weight",
            "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
            "decoder.block.2.layer.1.EncDecAttention.o.weight",
            "decoder.block.2.layer.2.layer_norm.weight"} <= names
    assert "encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight" not in names
    assert ("lm_head.weight" in names) == (kind == "flan")
    assert ("decoder.block.0.layer.2.DenseReluDense.wi_1.weight" in names) == (kind == "flan")
    loaded = from_pretrained(T5ForConditionalGeneration, str(tmp_path))
    assert loaded.cfg == T5Config.from_hf(CONFIGS[kind].to_hf())
    assert loaded.cfg.scale_output == (kind == "t5")
    ids, mask = source()
    dec = jnp.array([[0, 4, 8]] * 3)
    np.testing.assert_array_equal(loaded(ids, mask, dec), model(ids, mask, dec))


def test_config_from_transformers_5_and_the_hub():
    """transformers 5 always writes ``tie_word_embeddings: true``, with scale_decoder_outputs;
    the hub's flan-T5 configs say ``tie_word_embeddings: false``; T5 v1.0's say nothing."""
    flan = T5Config.from_hf({**CONFIGS["flan"].to_hf(), "tie_word_embeddings": True})
    assert not flan.tie_word_embeddings and not flan.scale_output
    hub_flan = {k: v for k, v in CONFIGS["flan"].to_hf().items() if k != "scale_decoder_outputs"}
    assert T5Config.from_hf(hub_flan) == CONFIGS["flan"]
    hub_t5 = T5Config.from_hf({"d_model": 32, "num_decoder_layers": None, "eos_token_id": [1]})
    assert hub_t5.tie_word_embeddings and hub_t5.scale_output and hub_t5.decoder_layers == hub_t5.num_layers
    assert hub_t5.eos_token_id == (1,)  # hashable: the config is static in the graph


def test_training_step_gives_finite_gradients_in_bfloat16():
    model, params = model_and_params("flan")
    apply_fn, params = split_model(model)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    ids, mask = source()
    labels = jnp.array([[4, 8, 1]] * 3)
    dec = jnp.concatenate([jnp.zeros((3, 1), jnp.int32), labels[:, :-1]], 1)

    def loss(p):
        logits = apply_fn(p, ids, mask, dec)
        assert logits.dtype == jnp.bfloat16
        logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
        return -jnp.take_along_axis(logprobs, labels[..., None], -1).mean()
    grads = jax.jit(jax.grad(loss))(params)
    assert all(bool(jnp.isfinite(g.astype(jnp.float32)).all()) for g in jax.tree.leaves(grads))
