"""The continuous-batching engine gives what ``generate`` gives one request at a time, while
requests join and leave the batch, on every decoder family and sharded; each request samples
its own way, and its samples share one prefill."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from redco import Deployer
from redco_zoo_models import generate
from redco_zoo_models.engine import Engine
from redco_zoo_models.engine_admission import MAX_PREFILL, prompts_per_prefill
from redco_zoo_models.engine_memory import rows_that_fit
from redco_zoo_models.gpt2 import GPT2Config, GPT2LMHeadModel
from redco_zoo_models.requests import Sampling
from redco_zoo_models.toy import tiny_family

PROMPTS = [[5, 9, 2], [7, 1, 3, 3, 8, 4, 4, 12, 30], [11], [3, 6, 9, 12, 15, 18],
           [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57]]
NEW = 9


@functools.cache
def model_of(name: str, seed: int = 0):
    """The tiny model of a family, built once a module (the engines read, never write, it):
    the tests of a family share its ``generate`` compiled. ``NAME``: its layers unrolled;
    ``NAME/scan``: stacked and scanned (``scan_layers``, the default), the same weights (built
    one by one, then stacked)."""
    if name == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2,
                                          n_head=4), nnx.Rngs(seed))
    if name.endswith("/scan"):
        unrolled = model_of(name.removesuffix("/scan"), seed)
        return type(unrolled)(dataclasses.replace(unrolled.cfg, scan_layers=True),
                              nnx.Rngs(seed))
    return tiny_family(name, seed, scan_layers=False)


@functools.cache
def engine_of(name: str, max_seqs: int, max_len: int) -> Engine:
    """A plain engine (rows of slots, no options) over ``model_of(name)``, built once per
    shape for the tests of every file that use or compare against one, so that its prefill and
    decode compile once. Each test leaves it idle (its requests run to the end)."""
    model = model_of(name)
    return Engine(model, nnx.state(model, nnx.Param), max_seqs=max_seqs, max_len=max_len)


_GENERATE = {}  # (id(model), n_new) -> the model's jitted ``generate`` (the model kept alive)
SLOTS, ROWS = 64, 8  # every tiny model's positions; the rows of every batch given ``generate``


def generated(model, params, prompts, n_new=NEW):
    """``generate`` on the prompts left-padded into one batch of ``ROWS`` x ``SLOTS - n_new``
    tokens (rows past the prompts repeat the first), jitted once per model and ``n_new`` (run
    eagerly, each of its ops would compile for every new length; at the prompts' own shape,
    each shape would): each prompt's ``(tokens, logprobs)``, as ``generate`` gives it alone
    (its padding is masked)."""
    key = (id(model), n_new)
    if key not in _GENERATE:
        _GENERATE[key] = model, jax.jit(lambda params, ids, mask: generate(
            model, params, ids, n_new, prompt_mask=mask, return_logprobs=True))
    width = SLOTS - n_new
    assert len(prompts) <= ROWS and max(map(len, prompts)) <= width, "a batch past the shape"
    ids, mask = np.zeros((ROWS, width), np.int32), np.zeros((ROWS, width), bool)
    for row in range(ROWS):
        prompt = prompts[row] if row < len(prompts) else prompts[0]
        ids[row, width - len(prompt):], mask[row, width - len(prompt):] = prompt, True
    tokens, logprobs = _GENERATE[key][1](params, ids, mask)
    return [([int(t) for t in row_tokens], np.asarray(row_logprobs))
            for row_tokens, row_logprobs in zip(tokens[:len(prompts)], logprobs)]


def one_at_a_time(model, params, prompt, n_new=NEW):
    """``generate``'s ``(tokens, logprobs)`` for one prompt."""
    return generated(model, params, [prompt], n_new)[0]


def greedy_tokens(model, params, index: int) -> list[int]:
    """``generate``'s greedy tokens for ``PROMPTS[index]`` alone (read from the batch of all
    ``PROMPTS``, whose padding is masked: one program a model)."""
    return generated(model, params, PROMPTS)[index][0]


@pytest.fixture(scope="module")
def llama():
    """Tiny Llama 3.1, its params and an engine of 4 rows of 32 slots: shared by the tests
    that need no other engine shape, so that its prefill and decode compile once."""
    model = model_of("llama-3.1")
    return model, nnx.state(model, nnx.Param), engine_of("llama-3.1", 4, 32)


def run_staggered(engine, prompts, sampling):
    """Two requests first; the rest join after three steps, while those run."""
    requests = [engine.submit(p, sampling) for p in prompts[:2]]
    for _ in range(3):
        engine.step()
    requests += [engine.submit(p, sampling) for p in prompts[2:]]
    engine.run_until_done(requests)
    return requests


@pytest.mark.parametrize("family", ["llama-3.1", pytest.param("gemma2", marks=pytest.mark.slow),
                                    "gemma3", pytest.param("qwen3-moe", marks=pytest.mark.slow),
                                    "gpt2", "gemma3/scan"])
def test_greedy_equals_generate_as_requests_come_and_go(family):
    """Gemma 2 is a slow-tier repeat: its sliding layers in the engine's cache are guarded in CI
    by the gemma3 case, its softcaps by test_parity_families' gemma2 cases. Qwen3-MoE is one
    too: the engine over experts is guarded in CI by test_sharded_engine_answers_as_one_device
    (the same model against ``generate``, split over dp x mp). ``gemma3/scan``: its layers
    scanned with the cache (a run of 2 sliding layers, then one layer alone of each kind), the
    engine's tokens and log-probs against the unrolled model's ``generate`` (transformers'
    in tests/zoo_parity); the paged pool scanned: tests/serve/test_serve.py's server."""
    engine = engine_of(family, 3, 32)
    requests = run_staggered(engine, PROMPTS, Sampling(max_tokens=NEW))
    reference = model_of(family.removesuffix("/scan"))
    expected = generated(reference, nnx.state(reference, nnx.Param), PROMPTS)
    for prompt, request, (tokens, logprobs) in zip(PROMPTS, requests, expected):
        assert request.samples[0].tokens == tokens, prompt
        np.testing.assert_allclose(request.samples[0].logprobs, logprobs, atol=2e-5)
        assert request.samples[0].finish_reason == "length"
    assert engine.rows == [None] * 3  # every row freed


@pytest.mark.parametrize("reading", [pytest.param({}, marks=pytest.mark.slow),
                                     dict(prefill_chunk=16, prefix_caching=True)])
def test_sharded_engine_answers_as_one_device(reading):
    """Also with prompts read 16 tokens a step and prefixes copied between rows split over dp
    (the longest prompt asked first and last: a hit). Prompts read whole are a slow-tier
    repeat: in CI the sharded decoding and experts are guarded by the other case, and a whole
    prompt's prefill over mp 2 by test_serve_recurrent.py (a plain server split over 2 devices,
    against transformers)."""
    model = model_of("qwen3-moe")
    params = nnx.state(model, nnx.Param)
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=None, verbose=False)
    rules = list(deployer.get_sharding_rules(params))
    sharded = jax.device_put(params, deployer.get_params_shardings(params, rules))
    assert any(len(x.sharding.device_set) == 8 and not x.sharding.is_fully_replicated
               for x in jax.tree.leaves(sharded))
    engine = Engine(model, sharded, max_seqs=4, max_len=32, mesh=deployer.mesh, **reading)
    assert engine.cache[0]["k"].sharding.spec[0] == "dp"
    prompts = PROMPTS[-1:] + PROMPTS  # (the first one read before its repeat comes)
    requests = run_staggered(engine, prompts, Sampling(max_tokens=NEW))
    alone = generated(model, params, PROMPTS)  # (each prompt's, as in the unsharded test)
    for request, (tokens, _) in zip(requests, alone[-1:] + alone):
        assert request.samples[0].tokens == tokens
    assert engine.prefix_stats.get("hits", 1) == 1


def test_a_seeded_request_samples_the_same_whatever_runs_beside_it(llama):
    engine = llama[2]
    mine = Sampling(max_tokens=NEW, temperature=0.9, top_k=20, top_p=0.9, seed=5)
    alone = engine.generate([PROMPTS[1]], mine)[0].samples[0]
    others = [engine.submit(p, Sampling(max_tokens=NEW, temperature=1.3, seed=i))
              for i, p in enumerate(PROMPTS[2:])]
    engine.step()
    beside = engine.generate([PROMPTS[1]], mine)[0].samples[0]
    assert all(r.done.is_set() for r in others)
    assert beside.tokens == alone.tokens
    np.testing.assert_allclose(beside.logprobs, alone.logprobs, atol=1e-6)
    other_seed = engine.generate([PROMPTS[1]], Sampling(**{**mine.__dict__, "seed": 6}))[0]
    assert other_seed.samples[0].tokens != alone.tokens


def test_sampling_cuts_and_tempered_logprobs_against_the_forward_pass(llama):
    """``top_k=1`` and a vanishing ``top_p`` leave only the greedy token (``generate``'s); a
    token sampled at temperature T comes with the forward pass's ``log_softmax(logits / T)``;
    a seeded request's tokens do not depend on ``steps_per_sync``."""
    model, params, engine = llama
    greedy = greedy_tokens(model, params, 1)
    for cut in (dict(top_k=1), dict(top_p=1e-6)):
        hot = Sampling(max_tokens=NEW, temperature=1.5, seed=4, **cut)
        assert engine.generate([PROMPTS[1]], hot)[0].samples[0].tokens == greedy, cut
    sample = engine.generate([PROMPTS[1]], Sampling(max_tokens=NEW, temperature=0.7,
                                                   seed=1))[0].samples[0]
    assert sample.tokens != greedy
    logits = model(jnp.asarray([PROMPTS[1] + sample.tokens]))[0]
    places = np.arange(NEW) + len(PROMPTS[1]) - 1
    expected = jax.nn.log_softmax(logits[places] / 0.7)[np.arange(NEW), sample.tokens]
    np.testing.assert_allclose(sample.logprobs, expected, atol=1e-4)
    seeded = Sampling(max_tokens=NEW, temperature=1.0, seed=9)
    every_token = Engine(model, params, max_seqs=4, max_len=32, steps_per_sync=1)
    assert every_token.generate([PROMPTS[1]], seeded)[0].samples[0].tokens == \
        engine.generate([PROMPTS[1]], seeded)[0].samples[0].tokens


def test_samples_of_a_prompt_share_one_prefill(llama):
    model, params, engine = llama
    prefills, prefill = [], engine._prefill
    engine._prefill = lambda *args: prefills.append(args[4].shape) or prefill(*args)
    try:
        sampled = engine.generate([PROMPTS[3]], Sampling(max_tokens=NEW, temperature=1.0, n=4,
                                                         seed=0))[0]
    finally:
        engine._prefill = prefill
    assert [shape[0] for shape in prefills] == [1]  # one call, one prompt row, for 4 samples
    assert len({tuple(s.tokens) for s in sampled.samples}) > 1  # each sample its own key
    greedy = engine.generate([PROMPTS[3]], Sampling(max_tokens=NEW, n=2))[0]
    expected = greedy_tokens(model, params, 3)
    assert [s.tokens for s in greedy.samples] == [expected, expected]


def test_stop_tokens_end_a_sample_and_free_its_row_for_the_next():
    model = model_of("llama-3.1")
    params = nnx.state(model, nnx.Param)
    expected = greedy_tokens(model, params, 0)
    engine = Engine(model, params, max_seqs=1, max_len=32, eos_token_ids=(expected[3],))
    first, second = [engine.submit(PROMPTS[0], Sampling(max_tokens=NEW)) for _ in range(2)]
    for _ in range(2 * NEW):  # a bound, so that a row never freed fails instead of hanging
        if second.done.is_set():
            break
        engine.step()
    assert second.done.is_set(), "the second request never got the row"
    for request in (first, second):  # one row: the second ran once the first had stopped
        assert request.samples[0].tokens == expected[:expected.index(expected[3]) + 1]
        assert request.samples[0].finish_reason == "stop"
    ended = engine.generate([PROMPTS[0]], Sampling(max_tokens=NEW, stop_token_ids=(expected[1],)))
    assert ended[0].samples[0].tokens == expected[:2]
    past = engine.generate([PROMPTS[0]], Sampling(max_tokens=NEW, ignore_eos=True))[0].samples[0]
    assert past.tokens == expected and past.finish_reason == "length"  # ran past the EOS


@pytest.mark.parametrize("reading", [{}, dict(prefill_chunk=16, prefix_caching=True)])
def test_warm_up_compiles_every_shape_a_request_can_meet(reading):
    """After ``warm_up``, requests of every prompt length, sample count and arrival order
    (decode steps over every span of slots: the longest runs to ``max_len``) compile nothing;
    nor do chunks read from any slot, after a cached prefix or not. The plain engine is the
    one the other tests of its shape ran (idle): what they compiled must be among the shapes
    ``warm_up`` counts, and its compiles are shared with theirs."""
    model = model_of("llama-3.1")
    engine = Engine(model, nnx.state(model, nnx.Param), max_seqs=3, max_len=32, **reading) \
        if reading else engine_of("llama-3.1", 3, 32)
    shapes = engine.warm_up()
    compiled = lambda: engine._decode._cache_size() + engine._prefill._cache_size()  # noqa: E731
    assert compiled() == shapes
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(1, 64, n)) for n in (1, 2, 5, 9, 16, 17, 30)]
    prompts += [prompts[-1][:16] + [1, 2], prompts[-1][:29]]  # (prefixes of 16 tokens)
    for n in (1, 2, 3):
        run_staggered(engine, prompts, Sampling(max_tokens=2, n=n, temperature=1.0))
    engine.generate(prompts[:3] * 3, Sampling(max_tokens=32 - 5))  # all at once, to the end
    assert compiled() == shapes
    assert engine.prefix_stats.get("hits", 1) > 0


def test_a_burst_of_short_prompts_is_read_in_one_prefill_on_weights_put_on_the_device():
    """What a step costs at many rows (bench/serve_http.py): prompts read at once while their
    padded chunks fit ``PREFILL_TOKENS`` (32 of 16 tokens, 16 of 32; ``MAX_PREFILL`` long
    ones), in a shape ``warm_up`` compiles; numpy weights put on the device once, not copied
    there by every step. No step runs (nothing compiles but the rows' keys)."""
    model = model_of("llama-3.1")
    on_host = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    for length, read in ((3, 32), (20, 16), (40, MAX_PREFILL)):
        engine = Engine(model, on_host, max_seqs=40, max_len=64)
        for _ in range(40):
            engine.submit([5] * length, Sampling(max_tokens=4))
        engine._admit()
        assert len(engine.reading) == read == prompts_per_prefill(engine._width(length))
        assert (read, engine._width(length)) in engine._prefill_shapes()
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(engine.params))


def test_requests_that_cannot_fit_are_refused_before_running():
    model = model_of("llama-3.1")
    engine = Engine(model, nnx.state(model, nnx.Param), max_seqs=2, max_len=16)
    with pytest.raises(ValueError, match="take 20 slots; this engine's sequences hold 16"):
        engine.submit(list(range(1, 12)), Sampling(max_tokens=9))
    with pytest.raises(ValueError, match="n=3 samples need as many rows"):
        engine.submit([1, 2], Sampling(max_tokens=4, n=3))
    with pytest.raises(ValueError, match=r"outside this model's vocabulary \(0 to 63\): \[64\]"):
        engine.submit([1, 64], Sampling(max_tokens=4))
    with pytest.raises(ValueError, match="top_p=0"):
        Sampling(top_p=0)
    longrope = model_of("phi-4-mini")
    with pytest.raises(ValueError, match="max_len=32 passes slot 16"):
        Engine(longrope, nnx.state(longrope, nnx.Param), max_len=32)


def test_rows_that_fit_fill_the_memory_left_beside_the_params():
    model = model_of("qwen3-moe")
    params = nnx.state(model, nnx.Param)
    held = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    one_row = Engine(model, params, max_seqs=1, max_len=32)
    row = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
        (one_row.cache, one_row.logits, one_row.key_valid)))
    assert rows_that_fit(model, params, 32, held + 10 * row) == 10
    assert rows_that_fit(model, params, 32, held + 10 * row - 1) == 9
    with pytest.raises(ValueError, match="no sequence of max_len 32"):
        rows_that_fit(model, params, 32, held + row - 1)
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=None, verbose=False)
    sharded = jax.device_put(params, deployer.get_params_shardings(
        params, list(deployer.get_sharding_rules(params))))
    on_mesh = rows_that_fit(model, sharded, 32, held + 10 * row, mesh=deployer.mesh)
    assert on_mesh > 4 * 10 and on_mesh % 4 == 0  # dp 4 splits the rows, mp 2 the heads


def test_rows_that_fit_a_recurrent_model_split_only_attention_heads():
    """Tiny Qwen3.5 over dp 4 x mp 2: a row holds, per device, each linear layer's whole conv
    inputs (2 x 56) and delta-rule state (4 x 8 x 6), the attention layer's keys and values over
    1 of its 2 key/value heads (32 slots x 8 each), its logits (64) in float32 and its key
    mask (32 bytes)."""
    model = model_of("qwen3.5")
    params = nnx.state(model, nnx.Param)
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=None, verbose=False)
    sharded = jax.device_put(params, deployer.get_params_shardings(
        params, list(deployer.get_sharding_rules(params))))
    held = sum(np.prod(x.sharding.shard_shape(x.shape)) * 4 for x in jax.tree.leaves(sharded))
    row = 2 * (2 * 56 + 4 * 8 * 6) * 4 + 2 * 32 * 1 * 8 * 4 + 64 * 4 + 32
    assert rows_that_fit(model, sharded, 32, held + 10 * row, mesh=deployer.mesh) == 40
    assert rows_that_fit(model, sharded, 32, held + 10 * row - 1, mesh=deployer.mesh) == 36


def test_a_step_that_raises_ends_its_requests_and_the_engine_serves_on():
    model = model_of("llama-3.1")
    engine = Engine(model, nnx.state(model, nnx.Param), max_seqs=2, max_len=32).start()
    try:
        decode, failures = engine._decode, [RuntimeError("device lost")]
        engine._decode = lambda *a, **k: (_ for _ in ()).throw(failures.pop()) if failures \
            else decode(*a, **k)
        broken = engine.submit(PROMPTS[0], Sampling(max_tokens=4))
        assert broken.done.wait(60), "a request of a failed step never ended"
        assert broken.samples[0].finish_reason == "error" and "device lost" in repr(broken.error)
        after = engine.submit(PROMPTS[0], Sampling(max_tokens=4))
        assert after.done.wait(120) and after.samples[0].finish_reason == "length"
    finally:
        engine.stop()
