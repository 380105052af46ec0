"""The decode layout (``redco_zoo_models.decode_layout``): the smallest tensor-parallel degree
whose compiled decode step fits the memory given, replicas over the rest; on it a decode step
moves no weight, where on FSDP's layout it gathers them; bad degrees and budgets refused."""
import jax
import pytest
from flax import nnx

from redco import plugins
from redco.sharding import make_mesh, shardings_from_specs, specs_from_rules
from redco_zoo_models import LlamaConfig, LlamaForCausalLM
from redco_zoo_models.decode_layout import (
    HEADROOM,
    choose_decode_layout,
    collective_bytes,
    compile_decode_step,
    decode_shardings,
    peak_bytes,
)

ROWS, SLOTS = 16, 256  # the cache (4 MiB) outweighs the weights (1.8 MiB)


@pytest.fixture(scope="module")
def model():
    """A 2-layer LLaMA, width 128, 4 key/value heads, built abstractly (nothing allocated)."""
    return nnx.eval_shape(lambda: LlamaForCausalLM(LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4), nnx.Rngs(0)))


def peak_at(model, mp: int) -> int:
    params, mesh = nnx.state(model, nnx.Param), make_mesh(jax.devices(), mp)
    return peak_bytes(compile_decode_step(model, params, mesh, decode_shardings(params, mesh),
                                          ROWS, SLOTS, steps_per_sync=4))


def choose(model, memory, **kwargs):
    return choose_decode_layout(model, nnx.state(model, nnx.Param), jax.devices(), ROWS, SLOTS,
                                memory, headroom=0.0, **kwargs)


def test_the_smallest_tensor_parallel_degree_whose_decode_step_fits_is_picked(model):
    one, two = peak_at(model, 1), peak_at(model, 2)
    assert two < one  # each device holds half the weights and half the cache's heads
    roomy = choose(model, one)
    assert (roomy.n_model_shards, dict(roomy.mesh.shape), roomy.peak_bytes) == \
        (1, {"dp": 8, "mp": 1}, one)  # 1 fits: the least communication, all replicas
    tight = choose(model, (one + two) // 2)
    assert (tight.n_model_shards, dict(tight.mesh.shape)) == (2, {"dp": 4, "mp": 2})
    assert tight.tried == {1: one, 2: two}  # both compiled: the weights alone fit either
    specs = [s.spec for s in jax.tree.leaves(tight.shardings)]
    assert not any("dp" in spec for spec in specs) and any("mp" in spec for spec in specs)
    assert choose(model, None).n_model_shards == 1  # no budget known: degree 1, uncompiled
    with pytest.raises(ValueError, match="No decode layout fits .* Lower the engine's rows"):
        choose(model, 1 << 16)
    with pytest.raises(ValueError, match=r"degrees \[3\] do not divide the 8 devices"):
        choose(model, None, degrees=(3,))
    params = nnx.state(model, nnx.Param)
    kept = lambda memory: choose_decode_layout(  # noqa: E731  (the default headroom)
        model, params, jax.devices(), ROWS, SLOTS, memory).n_model_shards
    assert two <= one * (1 - HEADROOM)  # (so that degree 2 is the one left when 1 is over)
    assert kept(one) == 2  # degree 1's peak fills the memory: over the 10% kept free
    assert kept(int(one / (1 - HEADROOM)) + 1) == 1


def test_a_decode_step_gathers_fsdp_weights_and_on_the_decode_layout_moves_none(model):
    """Under FSDP (weights split over 8 devices) the compiled decode step all-gathers weights
    whole (for some matmuls XLA all-reduces partial products of the few rows instead); on the
    decode layout of degree 1 (8 replicas, each its own rows) it moves no weight: what is left
    is each row's sampled token, its log-probability and key gathered for the host (tens of
    bytes a row)."""
    params = nnx.state(model, nnx.Param)
    fsdp_mesh = make_mesh(jax.devices(), 1)
    rules = plugins.lookup("sharding_rules", "fsdp")(params, fsdp_mesh)
    fsdp = shardings_from_specs(specs_from_rules(params, rules, fsdp_mesh), fsdp_mesh)
    split = sum(x.size * 4 for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(fsdp))
                if "dp" in s.spec)
    on_fsdp = collective_bytes(compile_decode_step(model, params, fsdp_mesh, fsdp, ROWS, SLOTS))
    assert on_fsdp["all-gather"] > split / 4 > 0, (on_fsdp, split)  # 0.44 of them seen
    layout = choose(model, 1 << 40)
    on_layout = collective_bytes(compile_decode_step(model, params, layout.mesh,
                                                     layout.shardings, ROWS, SLOTS))
    assert 0 < sum(on_layout.values()) <= 32 * ROWS, on_layout
