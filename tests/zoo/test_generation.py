"""Generation with a key/value cache gives what re-running the whole sequence gives: greedy,
left-padded prompts, beam search; and the same text sharded as on one device."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from rerun import greedy_without_cache

from redco_zoo_models import LlamaConfig, LlamaForCausalLM, generate, split_model
from redco_zoo_models.generation import pick_tokens

CFG = LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)


def model_and_params(seed=0):
    model = LlamaForCausalLM(CFG, nnx.Rngs(seed))
    return model, nnx.state(model, nnx.Param)


def test_cached_greedy_equals_rerunning_the_sequence():
    model, params = model_and_params()
    prompt = jax.random.randint(jax.random.PRNGKey(1), (3, 5), 0, CFG.vocab_size)
    got = jax.jit(lambda p, x: generate(model, p, x, 7))(params, prompt)
    np.testing.assert_array_equal(got, greedy_without_cache(model, prompt, 7))


def test_left_padded_prompts_generate_as_alone():
    model, params = model_and_params()
    short = jnp.array([[5, 9, 2]])
    padded = jnp.array([[0, 0, 5, 9, 2], [7, 1, 3, 3, 8]])
    mask = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    run = jax.jit(lambda p, ids, mask: generate(model, p, ids, 6, prompt_mask=mask))
    together = run(params, padded, mask)
    np.testing.assert_array_equal(together[0], run(params, short, jnp.ones_like(short))[0])
    np.testing.assert_array_equal(together[1], run(params, padded[1:], mask[1:])[0])


def test_sampled_tokens_logprobs_equal_the_training_forwards_in_fp32():
    """The sampler's log-probability of each token it drew is what a training step's forward
    pass over prompt + continuation gives the same token at the same temperature (fp32, to
    1e-5), left-padded prompts and EOS included (0 after it)."""
    model, params = model_and_params()
    prompt = jnp.array([[0, 0, 5, 9, 2], [7, 1, 3, 3, 8]])
    mask = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    def sample(eos):  # (jitted: eager, each op compiles)
        return jax.jit(lambda p: generate(model, p, prompt, 12, prompt_mask=mask,
                                          rng=jax.random.PRNGKey(3), temperature=0.7,
                                          eos_token_id=eos, return_logprobs=True))(params)
    eos = int(sample(None)[0][0, 4])  # the 5th token row 0 draws: it ends there
    tokens, logprobs = sample(eos)
    ids = jnp.concatenate([prompt, tokens], 1)
    segments = jnp.concatenate([mask, jnp.ones_like(tokens)], 1)  # padding: its own segment 0
    apply_fn, _ = split_model(model)
    logits = jax.jit(lambda p: apply_fn(p, ids, segment_ids=segments))(params)
    logits = logits[:, prompt.shape[1] - 1:-1]
    forward = jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32) / 0.7),
                                  tokens[..., None], -1)[..., 0]
    after_eos = jnp.cumsum(tokens == eos, 1) - (tokens == eos) > 0
    assert bool(after_eos[0, 5:].all())
    np.testing.assert_allclose(logprobs, jnp.where(after_eos, 0.0, forward), atol=1e-5)
    assert float(jnp.abs(logprobs).sum()) > 0


def test_g_samples_per_prompt_are_the_prompts_repeated_in_one_call():
    """``num_samples=G`` reads each prompt once and gives what G copies of it would: rows
    ``i*G .. i*G+G-1`` are prompt i's samples, drawn independently."""
    model, params = model_and_params()
    prompt = jnp.array([[0, 0, 5, 9, 2], [7, 1, 3, 3, 8]])
    mask = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    kwargs = dict(rng=jax.random.PRNGKey(4), temperature=1.0, return_logprobs=True)
    tokens, logprobs = jax.jit(lambda p: generate(model, p, prompt, 6, prompt_mask=mask,
                                                  num_samples=4, **kwargs))(params)
    copies = jax.jit(lambda p: generate(model, p, jnp.repeat(prompt, 4, 0), 6,
                                        prompt_mask=jnp.repeat(mask, 4, 0), **kwargs))(params)
    assert tokens.shape == (8, 6)
    np.testing.assert_array_equal(tokens, copies[0])
    np.testing.assert_allclose(logprobs, copies[1], atol=1e-6)
    assert len({tuple(row) for row in np.asarray(tokens[:4]).tolist()}) > 1  # not one sample x4


def sequence_logprob(model, prompt, continuation):
    ids = jnp.concatenate([prompt, continuation], 1)
    logprobs = jax.nn.log_softmax(model(ids)[:, prompt.shape[1] - 1:-1], -1)
    return jnp.take_along_axis(logprobs, continuation[..., None], -1).sum((1, 2))


def test_beam_search_finds_a_sequence_at_least_as_likely_as_greedy():
    model, params = model_and_params(3)
    prompt = jax.random.randint(jax.random.PRNGKey(2), (4, 4), 0, CFG.vocab_size)
    def run(num_beams):
        return jax.jit(lambda p, ids: generate(model, p, ids, 6, num_beams=num_beams))(params, prompt)
    greedy, beams = run(1), run(4)
    assert (sequence_logprob(model, prompt, beams) >= sequence_logprob(model, prompt, greedy)
            - 1e-5).all()
    np.testing.assert_array_equal(greedy_without_cache(model, prompt, 6), greedy)
    assert not (beams == greedy).all()  # with random weights the search does find better


def test_beam_search_stops_at_eos_and_pads():
    model, params = model_and_params(3)
    prompt = jax.random.randint(jax.random.PRNGKey(2), (4, 4), 0, CFG.vocab_size)
    free = jax.jit(lambda p, ids: generate(model, p, ids, 6, num_beams=3))(params, prompt)
    eos = int(free[0, 2])  # a token beam search wants to emit third for row 0
    out = jax.jit(lambda p, ids: generate(model, p, ids, 6, num_beams=3, eos_token_id=eos,
                                          pad_token_id=47))(params, prompt)
    for row in np.asarray(out):
        if eos in row:
            end = list(row).index(eos)
            assert (row[end + 1:] == 47).all()


def test_top_k_and_top_p_sample_only_from_the_allowed_tokens():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    rngs = jax.random.split(jax.random.PRNGKey(0), 400)

    def picked(**kwargs):  # 400 draws in one compiled call, not 400 eager ones
        draws = jax.jit(jax.vmap(lambda r: pick_tokens(logits, r, 1.0, **kwargs)[0]))(rngs)
        return set(np.asarray(draws).tolist())
    assert picked(top_k=2) == {0, 1} and picked(top_p=0.7) == {0, 1}
    assert picked(top_p=0.9) == {0, 1, 2}


@pytest.mark.parametrize("num_beams", [1, 3])
def test_sharded_generation_gives_the_same_tokens(num_beams):
    from redco import Deployer
    model, params = model_and_params(5)
    apply_fn, _ = split_model(model)
    deployer = Deployer(jax_seed=0, n_model_shards=2, verbose=False, workdir="/tmp/redco-gen")
    rules = deployer.get_sharding_rules(params, trace_fn=lambda p: apply_fn(
        p, jnp.zeros((1, 8), jnp.int32)))
    sharded = jax.device_put(params, deployer.get_params_shardings(params, rules))
    prompt = jax.random.randint(jax.random.PRNGKey(4), (8, 5), 0, CFG.vocab_size)
    run = jax.jit(lambda p, x: generate(model, p, x, 8, num_beams=num_beams))
    np.testing.assert_array_equal(run(sharded, prompt), run(params, prompt))
