"""Tiled attention (``redco_zoo_models.tiled_attention``) equals plain attention, forward and
backward, under every mask it takes, and never holds a whole (queries x keys) score matrix."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from redco_zoo_models.attention import attend
from redco_zoo_models.tiled_attention import merge, tiled_attention

SCALE = 0.3


def plain(q, k, v, q_rows, k_rows, q_seg, k_seg):
    """The reference: every score materialised, masked, softmaxed."""
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, 2), jnp.repeat(v, groups, 2)
    scores = jnp.einsum("bthd,bshd->bhts", q, k) * SCALE
    allowed = (k_rows[:, None, :] <= q_rows[:, :, None]) & (k_seg[:, None, :] == q_seg[:, :, None])
    scores = jnp.where(allowed[:, None], scores, -jnp.inf)
    top = scores.max(-1, keepdims=True)
    weights = jnp.exp(scores - jnp.where(jnp.isfinite(top), top, 0))
    total = weights.sum(-1, keepdims=True)
    return jnp.einsum("bhts,bshd->bthd", weights / jnp.where(total > 0, total, 1), v)


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


def grads(fn, arrays, masks, weights):
    return jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a, *masks) * weights), (0, 1, 2)))(*arrays)


@pytest.mark.parametrize("block", [7, 64])
def test_tiles_equal_plain_attention_and_its_gradients(inputs, block):
    """Tiles of 7 keys (40 keys: the last tile padded) and one tile of 64: outputs and
    the gradients of q, k and v within 1e-5 of plain attention; a query that sees no key
    gets 0 and a log-sum-exp of -inf."""
    (q, k, v, *masks), weights = inputs
    tiled = lambda *a: tiled_attention(*a, SCALE, block)[0]
    out, lse = tiled_attention(q, k, v, *masks, SCALE, block)
    np.testing.assert_allclose(out, plain(q, k, v, *masks), atol=1e-5)
    assert float(jnp.abs(out[0, 0]).max()) == 0 and float(lse[0, 0, 0]) == -np.inf
    for got, want in zip(grads(tiled, (q, k, v), masks, weights),
                         grads(plain, (q, k, v), masks, weights)):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_two_halves_merged_by_log_sum_exp_equal_the_whole(inputs):
    """Ring attention's fold: the keys in two halves, merged by ``merge``, give plain
    attention over all of them, gradients too (they flow through the log-sum-exps)."""
    (q, k, v, q_rows, k_rows, q_seg, k_seg), weights = inputs

    def halves(q, k, v, q_rows, k_rows, q_seg, k_seg):
        part = lambda sl: tiled_attention(q, k[:, sl], v[:, sl], q_rows, k_rows[:, sl], q_seg,
                                          k_seg[:, sl], SCALE, 8)
        return merge(part(slice(0, 20)), part(slice(20, None)))[0]
    masks = (q_rows, k_rows, q_seg, k_seg)
    np.testing.assert_allclose(halves(q, k, v, *masks), plain(q, k, v, *masks), atol=1e-5)
    for got, want in zip(grads(halves, (q, k, v), masks, weights),
                         grads(plain, (q, k, v), masks, weights)):
        np.testing.assert_allclose(got, want, atol=1e-5)


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
    np.testing.assert_allclose(ours(q, k, v), xla(q, k, v), atol=1e-5)
    weights = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    for got, want in zip(grads(ours, (q, k, v), (), weights), grads(xla, (q, k, v), (), weights)):
        np.testing.assert_allclose(got, want, atol=1e-5)
    scores = lambda n: 4 * n * n * 4
    assert causal_grad_temp_bytes(xla, 4096) > scores(4096)  # (the measure sees the matrix)
    temp = {n: causal_grad_temp_bytes(ours, n) for n in (4096, 8192)}
    assert temp[8192] < 2.5 * temp[4096], {n: f"{t / 1e6:.0f} MB" for n, t in temp.items()}
    assert temp[8192] < scores(8192) / 2, (f"{temp[8192] / 1e6:.0f} MB of temporaries, one "
                                           f"score matrix {scores(8192) / 1e6:.0f} MB")
