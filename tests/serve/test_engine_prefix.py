"""Chunked prefill and prefix caching in the engine: a prompt read a chunk a step (while other
rows decode), or after a cached prefix's slots copied from another row, gives ``generate``'s
tokens and the one-shot, uncached engine's log-probabilities; a weight change forgets the cached
prefixes; a row taken for another prompt is never read as a prefix."""
import numpy as np
import pytest
from flax import nnx
from test_engine import engine_of, generated, model_of, one_at_a_time

from redco_zoo_models.engine import Engine
from redco_zoo_models.requests import Sampling

NEW = 6
RNG = np.random.default_rng(0)
SYSTEM = [int(t) for t in RNG.integers(1, 64, 40)]  # 2 whole blocks of 16 and 8 tokens
LONG = [int(t) for t in RNG.integers(1, 64, 57)]  # 4 chunks of 16
SHORT = [5, 9, 2]


def same(request, expected_tokens, reference_logprobs):
    """``request``'s greedy tokens are ``generate``'s; its log-probabilities the reference's."""
    for sample in request.samples:
        assert sample.tokens == expected_tokens
        np.testing.assert_allclose(sample.logprobs, reference_logprobs, atol=1e-5)


@pytest.mark.parametrize("family", ["llama-3.1", "qwen3.5"])
def test_a_chunked_prefill_equals_the_one_shot_one_while_other_rows_decode(family):
    """A 57-token prompt read 16 tokens a step (4 steps) beside a decoding row: ``generate``'s
    tokens, the one-shot engine's log-probabilities; on Qwen3.5 each chunk starts from the state
    the last one left (its Gated DeltaNet layers hold no slots)."""
    model = model_of(family)
    params = nnx.state(model, nnx.Param)
    whole = engine_of(family, 3, 64).generate([LONG], Sampling(NEW))[0]
    chunked = Engine(model, params, max_seqs=2, max_len=64, prefill_chunk=16)
    short = chunked.submit(SHORT, Sampling(max_tokens=40))
    chunked.step()
    long = chunked.submit(LONG, Sampling(NEW))
    decoded = []
    while not long.samples[0].tokens:
        before = len(short.samples[0].tokens)
        chunked.step()
        decoded.append(len(short.samples[0].tokens) - before)
    assert decoded == [4, 4, 4, 4]  # 4 chunks read, the short row decoding beside each
    chunked.run_until_done([long, short])
    same(long, one_at_a_time(model, params, LONG, NEW)[0], whole.samples[0].logprobs)
    assert short.samples[0].tokens == one_at_a_time(model, params, SHORT, 40)[0]


def test_prefix_hits_equal_generate_and_the_uncached_engine():
    """Requests sharing a 40-token system prompt, arriving one by one and together, some with 2
    samples: the first reads it whole, the rest copy its 32 tokens of whole blocks from a
    row that still holds them (running, or ended while other rows decoded beside it)."""
    model = model_of("llama-3.1")
    params = nnx.state(model, nnx.Param)
    prompts = [SYSTEM + [3, 4, 5], SYSTEM + [7, 8, 9], SYSTEM + [3, 4, 5, 6, 1],
               SYSTEM[:32] + [60, 61, 62, 63, 1, 2]]  # (the last parts at the blocks' end)
    plain = engine_of("llama-3.1", 3, 64).generate(prompts, Sampling(NEW))
    engine = Engine(model, params, max_seqs=3, max_len=64, prefix_caching=True)
    first = engine.submit(prompts[0], Sampling(NEW))
    short = engine.submit(SHORT, Sampling(max_tokens=20))  # decodes on after the first ends
    engine.run_until_done([first, short])
    later = [engine.submit(prompts[1], Sampling(NEW, n=2))]  # in the first's row, and a copy
    engine.step()
    later += [engine.submit(p, Sampling(NEW)) for p in prompts[2:]]  # copied from a running
    engine.run_until_done(later)                                      # row; in a freed one
    for request, reference, (tokens, _) in zip([first] + later, plain,
                                               generated(model, params, prompts, NEW)):
        same(request, tokens, reference.samples[0].logprobs)
    assert short.samples[0].tokens == one_at_a_time(model, params, SHORT, 20)[0]
    assert engine.prefix_stats == {"hits": 3, "misses": 2, "tokens_reused": 3 * 32,
                                   "tokens_read": 43 + 3 + (43 - 32) + (45 - 32) + (38 - 32)}
    together = [LONG[:40] + [1, 2], LONG[:40] + [3, 4]]  # the second waits for the first
    for request, (expected, logprobs) in zip(engine.generate(together, Sampling(NEW)),
                                             generated(model, params, together, NEW)):
        same(request, expected, logprobs)
    assert engine.prefix_stats["hits"] == 4 and engine.prefix_stats["misses"] == 3


def test_new_weights_forget_the_cached_prefixes():
    """The same prompt after the params change: ``generate``'s tokens with the new weights (a
    hit would read keys the old weights computed)."""
    model, other = model_of("llama-3.1"), model_of("llama-3.1", seed=1)
    old, new = nnx.state(model, nnx.Param), nnx.state(other, nnx.Param)
    engine = Engine(model, old, max_seqs=2, max_len=64, prefix_caching=True)
    prompt = SYSTEM + [3, 4, 5]
    engine.generate([prompt], Sampling(NEW))
    engine.params = new
    again = [engine.submit(prompt, Sampling(NEW))]
    engine.step()
    again.append(engine.submit(prompt, Sampling(NEW)))  # hits the first (new keys)
    engine.run_until_done(again)
    uncached = Engine(other, new, max_seqs=2, max_len=64).generate([prompt], Sampling(NEW))[0]
    for request in again:
        same(request, one_at_a_time(other, new, prompt, NEW)[0], uncached.samples[0].logprobs)
    assert engine.prefix_stats["misses"] == 2 and engine.prefix_stats["hits"] == 1


def test_a_row_taken_for_another_prompt_is_no_prefix_any_more():
    """Two rows hold the system prompt and SHORT; a long prompt takes the system prompt's row
    (freed first) and is read a chunk a step; a request for the system prompt then finds no
    prefix (the row half holds the long prompt) and reads it whole."""
    model = model_of("llama-3.1")
    params = nnx.state(model, nnx.Param)
    engine = Engine(model, params, max_seqs=2, max_len=64, prefix_caching=True,
                    prefill_chunk=16)
    for prompt in (SYSTEM + [3, 4, 5], SHORT):  # in rows 0 and 1, freed in that order
        engine.generate([prompt], Sampling(NEW))
    long = engine.submit(LONG, Sampling(NEW))
    engine.step()
    assert engine.reading and engine.reading[0].rows == [0]  # the system prompt's row, half read
    asked = engine.submit(SYSTEM + [7, 8, 9], Sampling(NEW))
    engine.run_until_done([long, asked])
    assert engine.prefix_stats["hits"] == 0
    expected, logprobs = one_at_a_time(model, params, SYSTEM + [7, 8, 9], NEW)
    same(asked, expected, logprobs)


def test_chunks_and_prefixes_are_refused_where_they_cannot_work():
    llama, qwen = model_of("llama-3.1"), model_of("qwen3.5")
    with pytest.raises(ValueError, match="prefill_chunk=24: give a power of two >= 16"):
        Engine(llama, nnx.state(llama, nnx.Param), max_len=32, prefill_chunk=24)
    with pytest.raises(ValueError, match="recurrent layers .* leave prefix_caching off"):
        Engine(qwen, nnx.state(qwen, nnx.Param), max_len=32, prefix_caching=True)
