"""GPT-2 and VisionEncoderDecoder (ViT + GPT-2) in JAX alone: generation with a cache gives what
re-running the whole sequence gives, left padding, beam search, bf16, checkpoints round-trip."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from rerun import greedy_without_cache

from redco_zoo_models.generation import generate
from redco_zoo_models.gpt2 import GPT2Config, GPT2LMHeadModel
from redco_zoo_models.hf import from_pretrained, save_pretrained
from redco_zoo_models.nnx_utils import split_model
from redco_zoo_models.vision_encoder_decoder import VisionEncoderDecoderConfig, VisionEncoderDecoderModel
from redco_zoo_models.vit import ViTConfig

GPT2 = GPT2Config(vocab_size=48, n_positions=32, n_embd=32, n_layer=2, n_head=4)
VED = VisionEncoderDecoderConfig(
    ViTConfig(hidden_size=24, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
              image_size=8, patch_size=4),
    GPT2Config(vocab_size=48, n_positions=32, n_embd=32, n_layer=2, n_head=4,
               add_cross_attention=True))
PIXELS = jax.random.normal(jax.random.PRNGKey(5), (3, 3, 8, 8))


def params(model):
    return nnx.state(model, nnx.Param)


def jiggled(model, seed=0):
    """``model`` with every weight moved at random: the tokens it picks depend on its inputs."""
    leaves, tree = jax.tree.flatten(params(model))
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    nnx.update(model, jax.tree.unflatten(
        tree, [x + 0.2 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]))
    return model


def gen(model, prompt, n, encoder_inputs=None, **kwargs):
    """``generate``, jitted (one compilation rather than the prompt's ops one by one)."""
    run = jax.jit(lambda p, x, e: generate(model, p, x, n, encoder_inputs=e, **kwargs))
    return run(params(model), prompt, encoder_inputs)


def test_gpt2_cached_greedy_equals_rerunning_the_sequence():
    model = jiggled(GPT2LMHeadModel(GPT2, nnx.Rngs(0)))
    prompt = jax.random.randint(jax.random.PRNGKey(1), (3, 5), 0, GPT2.vocab_size)
    got = gen(model, prompt, 7)
    np.testing.assert_array_equal(got, greedy_without_cache(model, prompt, 7))


def test_gpt2_left_padded_prompts_generate_as_alone():
    model = jiggled(GPT2LMHeadModel(GPT2, nnx.Rngs(0)))
    padded = jnp.array([[0, 0, 5, 9, 2], [7, 1, 3, 3, 8]])
    mask = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    together = gen(model, padded, 6, prompt_mask=mask)
    np.testing.assert_array_equal(together[0], gen(model, padded[:1, 2:], 6)[0])
    np.testing.assert_array_equal(together[1], gen(model, padded[1:], 6)[0])
    # and a mask of ones is the plain causal (training) path
    apply_fn, weights = split_model(model)
    forward = jax.jit(lambda p, x, mask: apply_fn(p, x, attention_mask=mask))  # (eager: per op)
    np.testing.assert_allclose(forward(weights, padded, jnp.ones_like(padded)),
                               forward(weights, padded, None), atol=1e-6)


def test_vision_encoder_decoder_cached_greedy_equals_rerunning_the_sequence():
    model = jiggled(VisionEncoderDecoderModel(VED, nnx.Rngs(0)))  # 24 -> 32: enc_to_dec_proj
    start = jnp.ones((3, 1), jnp.int32)
    got = gen(model, start, 6, {"pixel_values": PIXELS})
    np.testing.assert_array_equal(got, greedy_without_cache(lambda ids: model(PIXELS, ids),
                                                            start, 6))
    assert not (got == got[:1]).all()  # the image matters


def sequence_logprob(logits_fn, prompt, continuation):
    ids = jnp.concatenate([prompt, continuation], 1)
    logprobs = jax.nn.log_softmax(logits_fn(ids)[:, prompt.shape[1] - 1:-1], -1)
    return jnp.take_along_axis(logprobs, continuation[..., None], -1).sum((1, 2))


@pytest.mark.slow  # REDCO_SLOW_TESTS=1: _beam_search: test_generation.py; caches: cached greedy
def test_beam_search_beats_or_ties_greedy():
    gpt2 = jiggled(GPT2LMHeadModel(GPT2, nnx.Rngs(4)), 4)
    ved = jiggled(VisionEncoderDecoderModel(VED, nnx.Rngs(4)), 4)
    prompt = jax.random.randint(jax.random.PRNGKey(2), (3, 4), 0, GPT2.vocab_size)
    cases = [(gpt2, prompt, None, gpt2),
             (ved, prompt[:, :1], {"pixel_values": PIXELS}, lambda ids: ved(PIXELS, ids))]
    for model, start, encoder_inputs, logits_fn in cases:
        greedy = gen(model, start, 5, encoder_inputs)
        beams = gen(model, start, 5, encoder_inputs, num_beams=3)
        assert beams.shape == (3, 5) and not (beams == greedy).all()
        assert (sequence_logprob(logits_fn, start, beams)
                >= sequence_logprob(logits_fn, start, greedy) - 1e-5).all()


def test_bf16_params_compute_in_bf16():
    model = VisionEncoderDecoderModel(VED, nnx.Rngs(0))
    nnx.update(model, jax.tree.map(lambda x: x.astype(jnp.bfloat16), params(model)))
    logits = jax.jit(lambda px, ids: model(px, ids))(PIXELS, jnp.ones((3, 2), jnp.int32))
    assert logits.dtype == jnp.bfloat16


def test_checkpoints_round_trip(tmp_path):
    for i, model in enumerate([GPT2LMHeadModel(GPT2, nnx.Rngs(0)),
                               VisionEncoderDecoderModel(VED, nnx.Rngs(0))]):
        save_pretrained(model, str(tmp_path / str(i)))
        back = from_pretrained(type(model), str(tmp_path / str(i)))
        assert back.cfg.to_hf() == model.cfg.to_hf()
        jax.tree.map(np.testing.assert_array_equal, params(back), params(model))
