"""The paged key/value cache (``Engine(page_size=...)``: ``redco_zoo_models.pages``,
``engine_paged``) against the slot engine as the outside reference: the same greedy tokens and
log-probabilities (to 1e-5) as requests come and go, on LLaMA and DeepSeek's latent
cache; requests admitted by the pages they may take (a count written out in the test), more than
the slots of the same memory hold; a prompt's whole pages shared by its samples (reference
counts), its partial last page copied; every page free at the end."""
import jax
import numpy as np
import pytest
from flax import nnx
from test_engine import NEW, PROMPTS, model_of, run_staggered

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


@pytest.mark.parametrize("family", ["llama-3.1", "deepseek-v3"])
def test_paged_decoding_equals_slots_as_requests_come_and_go(family):
    """3 rows, 5 requests, two joining the first's decoding; pages of 4 slots (prompts of 1 to
    18 tokens: partial pages, pages taken mid-decode). The pool is the cache: (pages, 4, ...)."""
    model = model_of(family)
    params = nnx.state(model, nnx.Param)
    sampling = Sampling(max_tokens=NEW)
    expected = run_staggered(Engine(model, params, max_seqs=3, max_len=32), PROMPTS, sampling)
    paged = Engine(model, params, max_seqs=3, max_len=32, page_size=PAGE, n_pages=20)
    assert {x.shape[:2] for x in jax.tree.leaves(paged.cache)} == {(20, PAGE)}
    got = run_staggered(paged, PROMPTS, sampling)
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
    expected = Engine(model, params, max_seqs=8, max_len=64).generate(prompts, sampling)
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
    expected = Engine(model, params, max_seqs=6, max_len=32).generate(prompts, sampling)
    assert_same_samples(requests, expected, "samples")
    assert_all_pages_free(paged)


def test_what_cannot_be_paged_is_refused_before_compiling():
    model = model_of("llama-3.1")
    params = nnx.state(model, nnx.Param)
    with pytest.raises(ValueError, match="page_size=5: give a size >= 1 that divides max_len"):
        Engine(model, params, max_len=32, page_size=5)
    with pytest.raises(ValueError, match="prefix_caching or an image model is not done"):
        Engine(model, params, max_len=32, page_size=4, prefix_caching=True)
    recurrent = model_of("qwen3.5")
    with pytest.raises(ValueError, match="recurrent layers .* not paged"):
        Engine(recurrent, nnx.state(recurrent, nnx.Param), max_len=32, page_size=4)
    engine = Engine(model, params, max_len=32, page_size=4, n_pages=3)
    with pytest.raises(ValueError, match="may take 4 pages of 4 slots; this engine's pool "
                                         "holds 3"):
        engine.submit([1] * 10, Sampling(max_tokens=6))
