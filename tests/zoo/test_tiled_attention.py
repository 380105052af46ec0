"""Tiled attention (``redco_zoo_models.tiled_attention``) equals plain attention, forward and
backward, under every mask it takes, and never holds a whole (queries x keys) score matrix; with
a sliding window and soft-capped scores (Gemma 2/3, Qwen3, Phi-3) and attention sinks (gpt-oss)
too, tiled, through ``attend`` and split over devices (context parallelism), as HuggingFace
transformers computes them."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from redco_zoo_models.attention import attend, decoder_inputs, within_window
from redco_zoo_models.context_parallel import SplitSequence, balance, sequence_parallel_attention
from redco_zoo_models.tiled_attention import merge, tiled_attention, with_sinks

SCALE = 0.3


def plain(q, k, v, q_rows, k_rows, q_seg, k_seg, window=None, softcap=None, scale=SCALE,
          sinks=None):
    """The reference: every score materialised, capped (HuggingFace's ``softcap * tanh(s /
    softcap)``), masked (the window: key rows ``> row - window``), softmaxed; with ``sinks``
    (H,), as transformers' gpt-oss: each head's sink a column of the softmax, then dropped."""
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, 2), jnp.repeat(v, groups, 2)
    scores = jnp.einsum("bthd,bshd->bhts", q, k) * scale
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    allowed = (k_rows[:, None, :] <= q_rows[:, :, None]) & (k_seg[:, None, :] == q_seg[:, :, None])
    if window is not None:
        allowed &= k_rows[:, None, :] > q_rows[:, :, None] - window
    scores = jnp.where(allowed[:, None], scores, -jnp.inf)
    if sinks is not None:
        column = jnp.broadcast_to(sinks[None, :, None, None], (*scores.shape[:-1], 1))
        scores = jnp.concatenate([scores, column], -1)
    top = scores.max(-1, keepdims=True)
    weights = jnp.exp(scores - jnp.where(jnp.isfinite(top), top, 0))
    total = weights.sum(-1, keepdims=True)
    weights = (weights / jnp.where(total > 0, total, 1))[..., :k.shape[1]]
    return jnp.einsum("bhts,bshd->bthd", weights, v)


@pytest.fixture(scope="module")
def inputs():
    """Grouped-query attention (4 heads, 2 K/V heads) of 24 queries to 40 keys, their rows
    shuffled (as a split sequence's are), packed into 3 segments; query 0 sees no key."""
    rng = np.random.default_rng(0)
    b, t, s, h, kv, d = 2, 24, 40, 4, 2, 8
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    k_rows = jnp.asarray(np.stack([rng.permutation(s) for _ in range(b)]), jnp.int32)
    k_seg = jnp.asarray(rng.integers(0, 3, (b, s)), jnp.int32)
    q_seg = k_seg[:, :t].at[0, 0].set(9)
    return (normal(b, t, h, d), normal(b, s, kv, d), normal(b, s, kv, d), k_rows[:, :t], k_rows,
            q_seg, k_seg), normal(b, t, h, d)


def out_and_grads(fn, arrays, weights, has_aux: bool = False):
    """``fn(*arrays)`` and the gradients of ``sum(fn(*arrays) * weights)`` by ``arrays`` (then
    ``fn``'s second output, with ``has_aux``), in one jitted program."""
    def run(*arrays):
        out, pull, *aux = jax.vjp(fn, *arrays, has_aux=has_aux)
        return (out, pull(weights.astype(out.dtype)), *aux)
    return jax.jit(run)(*arrays)


def assert_same(got, want, atol=1e-5):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, atol=atol)



@pytest.fixture(scope="module")
def reference(inputs):
    """``plain``'s output on ``inputs`` and its gradients."""
    (q, k, v, *masks), weights = inputs
    return out_and_grads(lambda q, k, v: plain(q, k, v, *masks), (q, k, v), weights)


@pytest.mark.parametrize("block", [7, 64])
def test_tiles_equal_plain_attention_and_its_gradients(inputs, reference, block):
    """Tiles of 7 keys (40 keys: the last tile padded) and one tile of 64: outputs and
    the gradients of q, k and v within 1e-5 of plain attention; a query that sees no key
    gets 0 and a log-sum-exp of -inf."""
    (q, k, v, *masks), weights = inputs
    tiled = lambda q, k, v: tiled_attention(q, k, v, *masks, SCALE, block)
    out, d_qkv, lse = out_and_grads(tiled, (q, k, v), weights, has_aux=True)
    assert_same((out, d_qkv), reference)
    assert float(jnp.abs(out[0, 0]).max()) == 0 and float(lse[0, 0, 0]) == -np.inf


def test_two_halves_merged_by_log_sum_exp_equal_the_whole(inputs, reference):
    """Ring attention's fold: the keys in two halves, merged by ``merge``, give plain
    attention over all of them, gradients too (they flow through the log-sum-exps)."""
    (q, k, v, q_rows, k_rows, q_seg, k_seg), weights = inputs

    def halves(q, k, v, q_rows, k_rows, q_seg, k_seg):
        part = lambda sl: tiled_attention(q, k[:, sl], v[:, sl], q_rows, k_rows[:, sl], q_seg,
                                          k_seg[:, sl], SCALE, 8)
        return merge(part(slice(0, 20)), part(slice(20, None)))[0]
    masks = (q_rows, k_rows, q_seg, k_seg)
    assert_same(out_and_grads(lambda q, k, v: halves(q, k, v, *masks), (q, k, v), weights),
                reference)


def causal_grad_temp_bytes(fn, n: int, heads: int = 4) -> int:
    """Temp bytes of the compiled gradient of a causal attention of ``n`` tokens."""
    x = jax.ShapeDtypeStruct((1, n, heads, 16), jnp.float32)
    step = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v)), (0, 1, 2)))
    return step.lower(x, x, x).compile().memory_analysis().temp_size_in_bytes


def test_a_long_causal_attention_runs_in_tiles_and_never_holds_a_score_matrix():
    """``attend`` over 1,100 tokens (more than one tile) equals XLA's attention, gradients
    included. Its backward pass's temporaries grow linearly with the sequence (4,096 -> 8,192
    tokens: under 2.5x; XLA's, quadratic) and at 8,192 tokens stay under half of one
    (heads x tokens x tokens) float32 score matrix, which XLA's exceed."""
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 1100, 4, 16)), jnp.float32) for _ in range(3))
    xla = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
    ours = lambda q, k, v: attend(q, k, v, is_causal=True)
    weights = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    assert_same(out_and_grads(ours, (q, k, v), weights), out_and_grads(xla, (q, k, v), weights))
    scores = lambda n: 4 * n * n * 4
    assert causal_grad_temp_bytes(xla, 4096) > scores(4096)  # (the measure sees the matrix)
    temp = {n: causal_grad_temp_bytes(ours, n) for n in (4096, 8192)}
    assert temp[8192] < 2.5 * temp[4096], {n: f"{t / 1e6:.0f} MB" for n, t in temp.items()}
    assert temp[8192] < scores(8192) / 2, (f"{temp[8192] / 1e6:.0f} MB of temporaries, one "
                                           f"score matrix {scores(8192) / 1e6:.0f} MB")


def test_a_window_and_capped_scores_in_tiles_equal_huggingfaces_formula(inputs, reference):
    """A sliding window of 9 rows and scores capped at 1.5, in tiles of 8 keys (40 keys,
    shuffled rows, 3 packed segments, grouped-query heads): outputs and the gradients of q, k
    and v (through the cap's derivative) within 1e-5 of the reference; the window leaves some
    queries no key (output 0)."""
    (q, k, v, *masks), weights = inputs
    tiled = lambda q, k, v: tiled_attention(q, k, v, *masks, SCALE, 8, window=9, softcap=1.5)[0]
    ours = out_and_grads(tiled, (q, k, v), weights)
    assert_same(ours, out_and_grads(lambda q, k, v: plain(q, k, v, *masks, window=9, softcap=1.5),
                                    (q, k, v), weights))
    unseen = jnp.all(ours[0] == 0, axis=(2, 3))
    assert 0 < int(unseen.sum()) < unseen.size // 2, int(unseen.sum())
    assert not np.allclose(ours[0], reference[0], atol=1e-2)  # (they change things)



def test_attention_sinks_in_tiles_and_through_attend_equal_transformers_formula(inputs):
    """gpt-oss's sinks (one logit per head in the softmax, no value): tiled (tiles of 8, a
    window of 9, shuffled rows, packed segments, a query that sees no key) and rescaled by the
    log-sum-exp (``with_sinks``), outputs and the gradients of q, k, v and the sinks within
    1e-5 of the reference; through ``attend`` written out (40 tokens, a window) and tiled (520
    tokens), and split over 2 devices (ring, a window across them, gradients), too."""
    (q, k, v, *masks), weights = inputs
    sinks = jnp.asarray([-1.0, 0.0, 0.5, 2.0])
    tiled = lambda q, k, v, s: with_sinks(*tiled_attention(q, k, v, *masks, SCALE, 8, window=9), s)
    ours = out_and_grads(tiled, (q, k, v, sinks), weights)
    want = out_and_grads(lambda q, k, v, s: plain(q, k, v, *masks, window=9, sinks=s),
                         (q, k, v, sinks), weights)
    assert_same(ours, want)
    assert not np.allclose(ours[0], out_and_grads(
        lambda q, k, v: plain(q, k, v, *masks, window=9), (q, k, v), weights)[0], atol=1e-2)
    for n, window in ((40, 7), (520, None)):
        (q, k, v), _, rows = causal_inputs(n)
        one = jnp.zeros_like(rows)
        got = jax.jit(lambda q, k, v: attend(q, k, v, is_causal=True, window=window, sinks=sinks))
        assert_same(got(q, k, v), plain(q, k, v, rows, rows, one, one, window=window,
                                        scale=8 ** -0.5, sinks=sinks))
    (q, k, v), weights, rows = causal_inputs(32)
    one = jnp.zeros_like(rows)
    want = out_and_grads(lambda q, k, v, s: plain(q, k, v, rows, rows, one, one, window=5,
                                                  scale=8 ** -0.5, sinks=s), (q, k, v, sinks),
                         weights)
    layer = SplitSequence(balance(rows, 2), one, Mesh(np.array(jax.devices()[:2]), ("cp",)),
                          "cp", "ring")
    ring = lambda q, k, v, s: layer.attend(q, k, v, window=5, sinks=s)
    got = out_and_grads(ring, [balance(x, 2) for x in (q, k, v)] + [sinks], balance(weights, 2))
    assert_same(got, [balance(x, 2) for x in jax.tree.leaves(want)[:4]] + [want[1][3]])


def causal_inputs(n: int, seed: int = 2):
    """q (2, n, 4, 8), k and v (2, n, 2, 8) of a causal attention, the weights of a loss on it,
    and their rows (2, n)."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    rows = jnp.broadcast_to(jnp.arange(n), (2, n))
    return (normal(2, n, 4, 8), normal(2, n, 2, 8), normal(2, n, 2, 8)), normal(2, n, 4, 8), rows


def test_attend_with_a_window_or_capped_scores_equals_huggingfaces_formula():
    """``attend(is_causal=True, ...)`` over 40 tokens with a window of 7 (XLA's attention under
    a windowed mask) and with the scores capped at 1.5 too (written out); a packed mask
    restricted by ``within_window``, capped; and 520 tokens (more than one tile: tiled
    attention) with a window of 100, capped: the reference's output within 1e-5."""
    (q, k, v), _, rows = causal_inputs(40)
    one = jnp.zeros_like(rows)
    segments = jnp.asarray(np.repeat([[1, 2, 3]], [12, 20, 8], axis=1).repeat(2, 0), jnp.int32)
    allowed = within_window(decoder_inputs(2, 40, segment_ids=segments)[1], 7)
    reference = lambda q, k, v, seg, window, softcap: plain(
        q, k, v, rows, rows, seg, seg, window=window, softcap=softcap, scale=8 ** -0.5)
    ours = jax.jit(lambda q, k, v: (attend(q, k, v, is_causal=True, window=7),
                                    attend(q, k, v, is_causal=True, window=7, softcap=1.5),
                                    attend(q, k, v, allowed, softcap=1.5)))
    want = jax.jit(lambda q, k, v: (reference(q, k, v, one, 7, None),
                                    reference(q, k, v, one, 7, 1.5),
                                    reference(q, k, v, segments, 7, 1.5)))
    assert_same(ours(q, k, v), want(q, k, v))
    (q, k, v), _, rows = causal_inputs(520)
    long = jax.jit(lambda q, k, v: attend(q, k, v, is_causal=True, window=100, softcap=1.5))
    one = jnp.zeros_like(rows)
    want = jax.jit(lambda q, k, v: plain(q, k, v, rows, rows, one, one, window=100, softcap=1.5,
                                         scale=8 ** -0.5))
    assert_same(long(q, k, v), want(q, k, v))


def test_split_attention_with_a_window_and_capped_scores_equals_unsplit():
    """Context parallelism with a window of 5 rows (across the devices' chunks of 4 or 8
    tokens) and scores capped at 1.5, packed rows: ``sequence_parallel_attention`` (all-gather,
    CP 4) and a model's ``SplitSequence.attend`` (ring, CP 2, gradients too) give the
    reference's within 1e-5."""
    (q, k, v), weights, rows = causal_inputs(32)
    segments = jnp.asarray(np.repeat([[1, 2, 0], [1, 1, 1]], [11, 14, 7], axis=1), jnp.int32)
    want = out_and_grads(lambda q, k, v: plain(q, k, v, rows, rows, segments, segments, window=5,
                                               softcap=1.5, scale=8 ** -0.5), (q, k, v), weights)
    mesh = lambda k_degree: Mesh(np.array(jax.devices()[:k_degree]), ("cp",))
    gathered = jax.jit(lambda q, k, v: sequence_parallel_attention(
        q, k, v, segments, mesh(4), strategy="all_gather", window=5, softcap=1.5))
    assert_same(gathered(q, k, v), want[0])
    layer = SplitSequence(balance(rows, 2), balance(segments, 2), mesh(2), "cp", "ring")
    ring = lambda q, k, v: layer.attend(q, k, v, window=5, softcap=1.5)
    laid_out = [balance(x, 2) for x in (q, k, v)]
    assert_same(out_and_grads(ring, laid_out, balance(weights, 2)),
                [balance(x, 2) for x in jax.tree.leaves(want)])
