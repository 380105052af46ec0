"""The Gated DeltaNet families (Qwen3.5, Qwen3-Next: ``toy.DELTA_NET_FAMILIES``): a fixed-size
decoding state, scanned layers. Parity (packed rows included):
tests/zoo_parity/test_parity_gated_deltanet.py; the serving engine:
tests/zoo_parity/test_parity_recurrent_engine.py; FSDP and tensor parallelism: test_families;
context parallelism: test_recurrent_split."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from redco_zoo_models.toy import tiny_family

IDS = jnp.asarray(np.random.RandomState(0).randint(1, 63, (2, 8)))


def test_the_decoding_state_has_a_fixed_size():
    """A linear layer's cache is its conv inputs and its delta-rule state, whatever the slots;
    an attention layer's grows with them."""
    model = tiny_family("qwen3.5")
    small, large = model.init_cache(2, 16), model.init_cache(2, 64)
    assert jax.tree.map(jnp.shape, small[0]) == jax.tree.map(jnp.shape, large[0]) == {
        "conv": (2, 2, 56), "state": (2, 4, 8, 6)}
    assert small[1]["k"].shape[1] == 16 and large[1]["k"].shape[1] == 64


def test_scanned_layers_compute_as_unrolled_ones():
    """Six layers alternating linear and full attention, stored stacked (groups of two): the
    unrolled model's logits."""
    from redco_zoo_models.llama import LlamaConfig, LlamaForCausalLM
    from redco_zoo_models.toy import TINY_FAMILIES
    cfg = LlamaConfig.from_hf(dict(TINY_FAMILIES["qwen3.5"], num_hidden_layers=6,
                                   layer_types=["linear_attention", "full_attention"] * 3))
    unrolled = LlamaForCausalLM(dataclasses.replace(cfg, scan_layers=False), nnx.Rngs(0))
    scanned = LlamaForCausalLM(dataclasses.replace(cfg, scan_layers=True), nnx.Rngs(0))
    assert "'0:6:2'" in str(jax.tree.leaves_with_path(nnx.state(scanned, nnx.Param)))
    np.testing.assert_allclose(jax.jit(lambda ids: scanned(ids))(IDS),
                               jax.jit(lambda ids: unrolled(ids))(IDS), atol=1e-6)
