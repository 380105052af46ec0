"""Frozen-parameter training with ``optax.multi_transform`` on a 2-D mesh.

Redco 0.4.x froze params before ``optimizer.init``, so its scripts label them with
``freeze(...)``; scripts written for this package label plain dicts. Both train here on
dp4 x mp2: the frozen params stay bitwise what they were, the optimizer state of the trained
ones is sharded like them, and the trained params equal a one-device run.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.core import freeze
from jax.sharding import PartitionSpec as P

from redco import Deployer, Trainer

HIDDEN = 16


def init_params(seed=0):
    rng = np.random.default_rng(seed)

    def dense(n_in, n_out):
        return {"kernel": rng.normal(0, n_in ** -0.5, (n_in, n_out)).astype(np.float32),
                "bias": np.zeros(n_out, np.float32)}
    return {"embed": dense(8, HIDDEN), "head": dense(HIDDEN, 1)}


def apply_fn(params, x):
    h = jnp.tanh(x @ params["embed"]["kernel"] + params["embed"]["bias"])
    return (h @ params["head"]["kernel"] + params["head"]["bias"])[:, 0]


def loss_fn(train_rng, state, params, batch, is_training):
    return jnp.mean((state.apply_fn(params, batch["x"]) - batch["y"]) ** 2)


def collate_fn(examples):
    return {"x": np.stack([e["x"] for e in examples]), "y": np.array([e["y"] for e in examples])}


def examples(n=256):
    rng = np.random.default_rng(1)
    w = rng.normal(size=8)
    return [{"x": x.astype(np.float32), "y": np.float32(np.sin(x @ w))}
            for x in rng.normal(size=(n, 8))]


def optimizer(frozen_labels: bool):
    labels = {"embed": {"kernel": "frozen", "bias": "frozen"},
              "head": {"kernel": "trained", "bias": "trained"}}
    return optax.multi_transform({"trained": optax.adam(1e-2), "frozen": optax.set_to_zero()},
                                 param_labels=freeze(labels) if frozen_labels else labels)


def train(tmp_path, frozen_labels: bool, n_devices: int | None):
    deployer = Deployer(jax_seed=0, n_model_shards=2 if n_devices is None else 1,
                        n_local_devices=n_devices, workdir=str(tmp_path / f"w{n_devices}"),
                        verbose=False)
    rules = [("embed/kernel", P(None, "mp")), ("head/kernel", P("mp", None))]
    trainer = Trainer(deployer=deployer, collate_fn=collate_fn, apply_fn=apply_fn,
                      loss_fn=loss_fn, params=init_params(), optimizer=optimizer(frozen_labels),
                      params_sharding_rules=rules)
    trainer.fit(examples(), per_device_batch_size=8 if n_devices is None else 32, n_epochs=3)
    return trainer


@pytest.mark.parametrize("frozen_labels", [True, False], ids=["0.4-frozen-labels", "dict-labels"])
def test_frozen_params_stay_and_trained_ones_match_one_device(tmp_path, frozen_labels):
    sharded = train(tmp_path, frozen_labels, None)
    assert dict(sharded.deployer.mesh.shape) == {"dp": 4, "mp": 2}
    start, params = init_params(), jax.device_get(sharded.params)
    for name in ("kernel", "bias"):  # frozen: bitwise what they were
        np.testing.assert_array_equal(params["embed"][name], start["embed"][name])
    assert not np.allclose(params["head"]["kernel"], start["head"]["kernel"])  # it did train

    # Adam's moments of the trained kernel are sharded like it, not replicated
    kernel_sharding = sharded.params["head"]["kernel"].sharding
    assert kernel_sharding.spec == P("mp", None)
    moments = [x for x in jax.tree.leaves(sharded.state.opt_state)
               if getattr(x, "shape", None) == (HIDDEN, 1)]
    assert len(moments) == 2 and all(m.sharding.spec == kernel_sharding.spec for m in moments)

    alone = jax.device_get(train(tmp_path, frozen_labels, 1).params)
    for name in ("kernel", "bias"):
        np.testing.assert_allclose(params["head"][name], alone["head"][name], atol=1e-5)
