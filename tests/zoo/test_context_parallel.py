"""Context parallelism's attention (``redco_zoo_models.context_parallel``): with the sequence
split over 2, 4 and 8 devices in the load-balanced layout, the all-gather and the ring strategy
give unsplit attention's output and gradients to 1e-5 in fp32, causal and packed (segment
ids), grouped-query heads included; the layout gives each device one early and one late chunk;
a length that does not split is refused naming the fix."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from redco_zoo_models.attention import attend, decoder_inputs
from redco_zoo_models.context_parallel import (
    balance,
    balanced_order,
    sequence_parallel_attention,
    unbalance,
)

B, N, H, KV, D = 2, 32, 4, 2, 8


def inputs(seed=0):
    q, k, v = (jax.random.normal(key, (B, N, heads, D)) for key, heads in
               zip(jax.random.split(jax.random.PRNGKey(seed), 3), (H, KV, KV)))
    segments = np.ones((B, N), np.int32)
    segments[0, 11:25], segments[0, 25:] = 2, 0  # row 0: two documents, then padding
    return q, k, v, jnp.asarray(segments)


def unsplit(q, k, v, segments):
    _, allowed = decoder_inputs(B, N, segment_ids=segments)
    return attend(q, k, v, allowed)


def test_the_balanced_layout_gives_each_device_an_early_and_a_late_chunk():
    order = np.asarray(balanced_order(16, 4))  # 8 chunks of 2
    assert order.reshape(4, 4).tolist() == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11],
                                            [6, 7, 8, 9]]
    x = jnp.arange(3 * 16).reshape(3, 16)
    np.testing.assert_array_equal(unbalance(balance(x, 4), 4), x)
    with pytest.raises(ValueError, match=r"30 tokens does not split into 2 x 4 equal chunks .* "
                                         r"pad the rows to a multiple of 8"):
        balanced_order(30, 4)


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
@pytest.mark.parametrize("k", [2, 4, 8])
def test_split_attention_equals_unsplit_attention_and_its_gradients(strategy, k):
    q, k_, v, segments = inputs()
    mesh = Mesh(np.array(jax.devices()[:k]), ("cp",))
    split = jax.jit(lambda q, k_, v: sequence_parallel_attention(q, k_, v, segments, mesh,
                                                                 strategy=strategy))
    np.testing.assert_allclose(split(q, k_, v), unsplit(q, k_, v, segments), atol=1e-5)
    weights = jax.random.normal(jax.random.PRNGKey(9), (B, N, H, D))
    def loss(f):
        return jax.grad(lambda *qkv: jnp.sum(f(*qkv) * weights), argnums=(0, 1, 2))(q, k_, v)
    for got, want in zip(loss(split), loss(lambda *qkv: unsplit(*qkv, segments))):
        np.testing.assert_allclose(got, want, atol=1e-5)
