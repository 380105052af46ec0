"""The paged key/value cache (``Engine(page_size=...)``: ``redco_zoo_models.pages``,
``engine_paged``) against the slot engine as the outside reference: the same greedy tokens and
log-probabilities (to 1e-5) as requests come and go, on LLaMA, DeepSeek's latent cache and
Qwen3.5's hybrid (recurrent states a row each beside the pool); requests admitted by the pages
they may take (a count written out in the test), more than the slots of the same memory hold; a
prompt's whole pages shared by its samples (reference counts), its partial last page copied;
every page free at the end. Prefix caching on pages: the row-based cache's hits (its
``prefix_stats``) with the cached pages listed in the new sequence's table, not copied; evicted
deepest block first when a request needs the room; let go of when the weights change."""
import types

import jax
import numpy as np
import pytest
from flax import nnx
from test_engine import NEW, PROMPTS, engine_of, generated, model_of, run_staggered
from test_engine_prefix import LONG, SHORT, SYSTEM

from redco_zoo_models.engine import Engine
from redco_zoo_models.requests import Sampling

PAGE = 4


def assert_all_pages_free(engine):
    pages = engine.pages
    assert sorted(pages.free) == list(range(pages.n_pages))
    assert not pages.refs.any() and (pages.table == pages.n_pages).all()


def assert_same_samples(got, expected, what):
    for a, b in zip(got, expected):
        for sample, reference in zip(a.samples, b.samples):
            assert sample.tokens == reference.tokens, (what, a.prompt)
            np.testing.assert_allclose(sample.logprobs, reference.logprobs, atol=1e-5)


def reference(family, model, params, sampling):
    """What the paged engine must give for ``run_staggered(PROMPTS)``: the slot engine's
    samples; Qwen3.5's from ``generate`` (one program, where no slot engine of this shape is
    compiled elsewhere: 3 CPU s less), which the slot engine gives too (test_engine_prefix)."""
    if family != "qwen3.5":
        return run_staggered(engine_of(family, 3, 32), PROMPTS, sampling)
    return [types.SimpleNamespace(prompt=prompt, samples=[types.SimpleNamespace(
        tokens=tokens, logprobs=logprobs)]) for prompt, (tokens, logprobs) in
        zip(PROMPTS, generated(model, params, PROMPTS))]


@pytest.mark.parametrize("family", ["llama-3.1", "deepseek-v3", "qwen3.5"])
def test_paged_decoding_equals_slots_as_requests_come_and_go(family):
    """3 rows, 5 requests, two joining the first's decoding; pages of 4 slots (prompts of 1 to
    18 tokens: partial pages, pages taken mid-decode), read 16 tokens a step (the 18-token
    prompt in 2 chunks, the others decoding beside it). The pool is the cache: (pages, 4, ...);
    on Qwen3.5 (hybrid) the attention layer's, its Gated DeltaNet states (conv inputs (3, 2,
    56), delta-rule (3, 4, 8, 6)) a row each beside it, carried from chunk to chunk and copied
    into a prompt's second sample's row (2 greedy samples: the reference's tokens)."""
    model = model_of(family)
    params = nnx.state(model, nnx.Param)
    sampling = Sampling(max_tokens=NEW)
    expected = reference(family, model, params, sampling)
    paged = Engine(model, params, max_seqs=3, max_len=32, page_size=PAGE, n_pages=20,
                   prefill_chunk=16)
    shapes = {x.shape[:2] for x in jax.tree.leaves(paged.cache)}
    assert shapes == ({(20, PAGE)} if family != "qwen3.5" else {(20, PAGE), (3, 2), (3, 4)})
    got = run_staggered(paged, PROMPTS, sampling)
    if family == "qwen3.5":
        got += paged.generate([PROMPTS[1]], Sampling(max_tokens=NEW, n=2))
        expected += [types.SimpleNamespace(prompt=PROMPTS[1], samples=expected[1].samples * 2)]
    assert_same_samples(got, expected, family)
    assert_all_pages_free(paged)


def test_requests_are_admitted_by_pages_beyond_the_slots_of_the_same_memory():
    """12 pages of 8 slots: the memory of one and a half rows of 64 slots. Each request reserves
    ceil((prompt + max_tokens) / 8) pages at admission; the leading requests whose sum fits 12
    are admitted together (rows and prompts read at once are no limit here)."""
    model = model_of("llama-3.1")
    params = nnx.state(model, nnx.Param)
    prompts = [[3, 4], [7] * 9, [1], [5, 6, 7, 8, 9, 10], [2] * 18, [9, 9, 8], [4] * 11, [6]]
    sampling, n_pages, page = Sampling(max_tokens=6), 12, 8
    need = [-(-(len(p) + 6) // page) for p in prompts]  # [1, 2, 1, 2, 3, 2, 3, 1]
    admitted = int((np.cumsum(need) <= n_pages).sum())
    assert admitted == 6 and admitted > n_pages * page // 64
    paged = Engine(model, params, max_seqs=8, max_len=64, page_size=page, n_pages=n_pages)
    requests = [paged.submit(p, sampling) for p in prompts]
    paged.step()
    assert sum(row is not None for row in paged.rows) == admitted
    assert paged.pages.available() == n_pages - sum(need[:admitted])
    paged.run_until_done(requests)
    expected = engine_of("llama-3.1", 3, 64).generate(prompts, sampling)  # (rows: no matter)
    assert_same_samples(requests, expected, "admitted by pages")
    assert_all_pages_free(paged)


def test_samples_share_their_prompts_whole_pages_and_copy_the_partial_one():
    """3 seeded samples of a 9-token prompt (two whole pages and one partial) and of an 8-token
    one (two whole pages): the whole pages are held once with a count of 3, each sample decodes
    on its own copy of the partial page; the tokens are the slot engine's."""
    model = model_of("llama-3.1")
    params = nnx.state(model, nnx.Param)
    prompts = [PROMPTS[1], PROMPTS[1][:8]]
    sampling = Sampling(max_tokens=NEW, n=3, temperature=1.0, seed=3)
    paged = Engine(model, params, max_seqs=6, max_len=32, page_size=PAGE)
    requests = [paged.submit(p, sampling) for p in prompts]
    paged.step()  # (the prompts read, each sample's first tokens decoded)
    for rows in ([0, 1, 2], [3, 4, 5]):
        shared = paged.pages.table[rows, :2]
        assert (shared == shared[0]).all() and (paged.pages.refs[shared[0]] == 3).all()
    own = paged.pages.table[[0, 1, 2], 2]
    assert len(set(own.tolist())) == 3  # the partial page: one each
    paged.run_until_done(requests)
    expected = engine_of("llama-3.1", 3, 64).generate(prompts, sampling)  # (one after another)
    assert_same_samples(requests, expected, "samples")
    assert_all_pages_free(paged)


def cached_pages(engine, prompt=None):
    """The pages the prefix cache holds (of ``prompt``'s blocks, in order)."""
    entries = engine.prefix.entries
    if prompt is None:
        return [page for page, *_ in entries.values()]
    return [entries[key][0] for key in engine.prefix.keys(prompt) if key in entries]


def test_prefixes_on_pages_hit_as_the_row_cache_and_share_the_pages():
    """The row-based cache's request sequence (``test_engine_prefix``: a 40-token system prompt
    asked alone, with 2 samples, beside running rows), read 16 tokens a step in both engines:
    the same tokens, log-probabilities and ``prefix_stats``. The system prompt's 2 whole pages
    outlive their sequence in the cache alone (count 1), a hit lists them in its table (count 1
    + its 2 samples); at the end the cache alone holds pages, and new weights free them."""
    model = model_of("llama-3.1")
    params = nnx.state(model, nnx.Param)
    prompts = [SYSTEM + [3, 4, 5], SYSTEM + [7, 8, 9], SYSTEM + [3, 4, 5, 6, 1],
               SYSTEM[:32] + [60, 61, 62, 63, 1, 2]]
    options = dict(max_seqs=3, max_len=64, prefix_caching=True, prefill_chunk=16)
    engines = [Engine(model, params, **options),
               Engine(model, params, page_size=16, n_pages=12, **options)]
    runs = []
    for engine in engines:
        first = engine.submit(prompts[0], Sampling(NEW))
        short = engine.submit(SHORT, Sampling(max_tokens=20))
        engine.run_until_done([first, short])
        later = [engine.submit(prompts[1], Sampling(NEW, n=2))]
        engine.step()
        if engine.pages is not None:
            pages, held = cached_pages(engine, prompts[0]), engine.pages
            rows = [i for i, row in enumerate(engine.rows) if row and row[0] is later[0]]
            assert len(pages) == len(rows) == 2 and (held.table[rows, :2] == pages).all()
            assert (held.refs[pages] == 3).all()
        later += [engine.submit(p, Sampling(NEW)) for p in prompts[2:]]
        engine.run_until_done(later)
        runs.append([first, short] + later)
    slots, paged = engines
    assert_same_samples(runs[1], runs[0], "prefix hits")
    assert paged.prefix_stats == slots.prefix_stats and paged.prefix_stats["hits"] == 3
    pages = cached_pages(paged)  # (every prompt's whole pages are the system prompt's 2)
    assert sorted(pages) == sorted(cached_pages(paged, SYSTEM))
    assert paged.pages.n_pages - len(paged.pages.free) == len(pages) == 2
    assert (paged.pages.refs[pages] == 1).all()
    paged.params = params
    assert_all_pages_free(paged)


def test_a_request_that_needs_the_room_evicts_the_deepest_cached_page_first():
    """5 pages of 16: the system prompt's sequence ends, its 2 whole pages cached (3 free); a
    56-slot request needs 4 and evicts one, the prefix's second block; the system prompt asked
    again then reuses its first block only (16 tokens). Tokens as the slot engine's."""
    model = model_of("llama-3.1")
    params = nnx.state(model, nnx.Param)
    prompts = [SYSTEM + [3, 4, 5], LONG[:50], SYSTEM + [7, 8, 9]]
    paged = Engine(model, params, max_seqs=2, max_len=64, page_size=16, n_pages=5,
                   prefix_caching=True)
    requests = paged.generate(prompts[:1], Sampling(NEW))
    assert len(cached_pages(paged)) == 2 and len(paged.pages.free) == 3
    requests += paged.generate(prompts[1:2], Sampling(NEW))
    assert len(cached_pages(paged, prompts[0])) == 1 and len(cached_pages(paged)) == 1 + 3
    requests += paged.generate(prompts[2:], Sampling(NEW))
    assert paged.prefix_stats["tokens_reused"] == 16
    expected = engine_of("llama-3.1", 3, 64).generate(prompts, Sampling(NEW))
    assert_same_samples(requests, expected, "evicted")


def test_what_cannot_be_paged_is_refused_before_compiling():
    model = model_of("llama-3.1")
    params = nnx.state(model, nnx.Param)
    with pytest.raises(ValueError, match="page_size=5: give a size >= 1 that divides max_len"):
        Engine(model, params, max_len=32, page_size=5)
    engine = Engine(model, params, max_len=32, page_size=4, n_pages=3)
    with pytest.raises(ValueError, match="may take 4 pages of 4 slots; this engine's pool "
                                         "holds 3"):
        engine.submit([1] * 10, Sampling(max_tokens=6))
