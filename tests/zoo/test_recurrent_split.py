"""Context parallelism on the recurrent families (``redco_zoo_models.recurrent_split``): with
the sequence split over 2 and 4 devices, a Gated DeltaNet model (Qwen3.5) and a Mamba2 hybrid
(Granite 4) give unsplit logits to 1e-5 (measured ~1e-7), unpacked, packed (documents that
start inside a device's chunk and span devices) and padded (left, and in the middle); two
updates through ``Trainer`` at dp x cp x mp equal one device's. The models are one recurrent
layer each (the split is per layer; attention's own split: test_context_parallel.py), so each
check compiles one layer, not three; a prompt read into a cache split, and chunks shorter than
the convolution, are refused naming the fix."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from redco import Deployer, Trainer, sequence_split
from redco_zoo_models import LlamaConfig, LlamaForCausalLM, split_model
from redco_zoo_models.toy import TINY_FAMILIES

IDS = jnp.asarray(np.random.RandomState(2).randint(1, 63, (2, 64)))
INPUTS = {
    "unpacked": {},
    "packed": {"segment_ids": jnp.asarray([[1] * 12 + [2] * 12 + [3] * 40, [1] * 64])},
    "padded": {"attention_mask": jnp.asarray([[0] * 5 + [1] * 59,
                                              [1] * 30 + [0] * 4 + [1] * 30])},
}


def model_of(family: str, *layer_types: str):
    """The family's tiny model, its layers ``layer_types`` where given."""
    config = dict(TINY_FAMILIES[family])
    if layer_types:
        config.update(layer_types=list(layer_types), num_hidden_layers=len(layer_types))
    return split_model(LlamaForCausalLM(LlamaConfig.from_hf(config), nnx.Rngs(0)))


def context_mesh(k: int, **kwargs):
    return Deployer(jax_seed=0, n_context_shards=k, workdir=None, verbose=False, **kwargs).mesh


@pytest.mark.parametrize("family, layer, k", [("qwen3.5", "linear_attention", 4),
                                              ("granite-4-h", "mamba", 2)])
def test_split_logits_equal_unsplit_logits(family, layer, k):
    """8 chunks of 8 tokens (Qwen3.5: its convolution reads 2 before each) and 4 of 16
    (Granite: 3); the state crosses every device boundary, in the balanced order (device d
    holds chunks d and 2k - 1 - d). Packed, the second document starts inside a chunk and
    spans devices, the third starts at a chunk (8 x 3, on the next device at k = 4) and takes
    a zero state there."""
    apply_fn, params = model_of(family, layer)
    mesh = context_mesh(k)

    def every_input(p):  # (the three inputs in one program: one compile a side)
        return {name: apply_fn(p, IDS, **kw) for name, kw in INPUTS.items()}
    want = jax.device_get(jax.jit(every_input)(params))
    with sequence_split.splitting(mesh, "ring"):  # (a function of its own: traced anew)
        got = jax.device_get(jax.jit(lambda p: every_input(p))(params))
    for name, kwargs in INPUTS.items():
        real = np.asarray(kwargs.get("attention_mask", np.ones(IDS.shape)), bool)
        np.testing.assert_allclose(got[name][real], want[name][real], atol=1e-5,
                                   err_msg=name)


def test_a_split_model_trains_as_one_device():
    """Two SGD updates of packed rows at dp 2 x cp 2 x mp 2 (FSDP): one device's params. At a
    learning rate of 4, a gradient stopped at the states entering each chunk shows (1.3e-5)."""
    rng = np.random.RandomState(3)
    rows = [{"input_ids": rng.randint(1, 63, 65),  # 64 inputs
             "segment_ids": np.asarray([1] * cut + [2] * (65 - cut))}
            for cut in rng.randint(3, 60, 8)]

    def loss_fn(rng, state, params, batch, is_training):
        ids, segments = batch["input_ids"], batch["segment_ids"]
        logits = state.apply_fn(params, ids[:, :-1], segment_ids=segments[:, :-1])
        logps = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logps, ids[:, 1:, None], -1))

    def trained(**kwargs):
        apply_fn, params = model_of("qwen3.5", "linear_attention")
        deployer = Deployer(jax_seed=0, workdir=None, verbose=False, **kwargs)
        trainer = Trainer(deployer, lambda rows: {k: np.stack([r[k] for r in rows])
                                                  for k in rows[0]},
                          apply_fn, loss_fn, params, optax.sgd(4.0))
        trainer.train_epoch(rows, 4 // deployer.dp_size, 0)
        return jax.tree.leaves(jax.device_get(trainer.params))

    one = trained(n_local_devices=1)
    split = trained(n_model_shards=2, n_context_shards=2, sharding_rules="auto+fsdp")
    for a, b in zip(split, one):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_what_a_split_recurrent_model_cannot_do_is_refused():
    apply_fn, params = model_of("qwen3.5")
    with sequence_split.splitting(context_mesh(8)), pytest.raises(
            ValueError, match=r"16 tokens split into 16 chunks of 1: .* reads the 2 tokens "
                              r"before each chunk.*fewer context shards"):
        jax.eval_shape(lambda p: apply_fn(p, IDS[:, :16]), params)
    model = LlamaForCausalLM(LlamaConfig.from_hf(TINY_FAMILIES["granite-4-h"]), nnx.Rngs(0))
    cache = model.init_cache(2, 64)
    with sequence_split.splitting(context_mesh(2)), pytest.raises(
            ValueError, match="prompt into a cache .* generate with n_context_shards=1"):
        jax.eval_shape(lambda c: model(IDS, cache=c, cache_index=0), cache)
