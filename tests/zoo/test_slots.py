"""The capacity slots' moves (``redco_zoo_models.slots``) against the same moves written as one-hot
matrices: the same buffer and outputs, and the same gradients (their backward passes are each
other's forward, written by hand: ``jax.custom_vjp``), with dropped pairs and padding tokens."""
import jax
import jax.numpy as jnp
import numpy as np

from redco_zoo_models.slots import combine, dispatch, slots

N_EXPERTS, CAPACITY, TOP_K, N, H = 4, 3, 2, 9, 5


def one_hot_moves(places):
    """(E*C, n, k): 1 where a row holds the pair (token, choice)."""
    return jax.nn.one_hot(places, N_EXPERTS * CAPACITY).transpose(2, 0, 1)


def test_dispatch_and_combine_equal_their_one_hot_matrices_forward_and_backward():
    rng = np.random.RandomState(0)
    # every token's first choice expert 0 (over its capacity: pairs dropped), its second one of
    # the others (9 slots for 8 pairs: a row left empty); the last token pads (no expert)
    chosen = np.stack([[0, rng.randint(1, N_EXPERTS)] for _ in range(N)])
    chosen[-1] = N_EXPERTS
    places, kept = slots(jnp.asarray(chosen), N_EXPERTS, CAPACITY)
    assert int(kept) == CAPACITY + N - 1  # expert 0's 3 rows, every second choice
    tokens = jnp.asarray(rng.randn(N, H), jnp.float32)
    out = jnp.asarray(rng.randn(N_EXPERTS, CAPACITY, H), jnp.float32)
    weights = jnp.asarray(rng.rand(N, TOP_K), jnp.float32)
    moves = one_hot_moves(places)

    def ours(tokens, out, weights):
        buffer = dispatch(tokens, places, N_EXPERTS, CAPACITY)
        return buffer, combine(out * jnp.cos(buffer), places, weights)

    def reference(tokens, out, weights):
        buffer = jnp.einsum("rnk,nh->rh", moves, tokens).reshape(out.shape)
        rows = (out * jnp.cos(buffer)).reshape(-1, H)
        return buffer, jnp.einsum("rnk,rh,nk->nh", moves, rows, weights)

    for a, b in zip(jax.jit(ours)(tokens, out, weights), reference(tokens, out, weights)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)

    def loss(f):
        return lambda *args: sum(jnp.sum(jnp.sin(y) * (i + 1)) for i, y in enumerate(f(*args)))
    grads = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))(tokens, out, weights)
    expected = jax.grad(loss(reference), argnums=(0, 1, 2))(tokens, out, weights)
    for a, b in zip(grads, expected):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(grads[0][-1]).max()) == 0  # the padding token feels nothing
