"""``loss_fn`` may return ``(loss, {name: scalar})``: the scalars are logged with each update
(the mean of its micro-batches), left out of the gradient and of evaluation; anything but
scalars under new names is refused before compiling."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import mlp_apply, mlp_collate, mlp_examples, mlp_init, mlp_loss

import redco
from redco import Deployer, Trainer


class Metrics:
    def __init__(self):
        self.steps = []

    @redco.hookimpl
    def on_step_end(self, trainer, step, metrics):
        self.steps.append(metrics)


def with_metrics(rng, state, params, batch, is_training):
    if not isinstance(is_training, bool):  # loss functions branch on it (HF Flax's models do)
        raise TypeError(f"is_training is {is_training!r}, not a Python bool")
    error = state.apply_fn(params, batch["x"]) - batch["y"]
    return jnp.mean(error ** 2), {"mae": jnp.mean(jnp.abs(error)),
                                  "rows": jnp.float32(batch["x"].shape[0])}


def train(workdir, loss_fn, accumulate=1):
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=workdir, verbose=False)
    seen = Metrics()
    trainer = Trainer(deployer, mlp_collate, mlp_apply, loss_fn, mlp_init(), optax.adam(1e-2),
                      accumulate_grad_batches=accumulate, callbacks=[seen])
    trainer.fit(mlp_examples(64), per_device_batch_size=2, n_epochs=2)
    return trainer, seen.steps


@pytest.mark.parametrize("accumulate", [1, 2])
def test_metrics_are_logged_per_update_and_change_nothing_trained(tmp_path, accumulate):
    plain, plain_steps = train(str(tmp_path / "plain"), mlp_loss, accumulate)
    logged, steps = train(str(tmp_path / "logged"), with_metrics, accumulate)
    for a, b in zip(jax.tree.leaves(plain.params), jax.tree.leaves(logged.params)):
        np.testing.assert_array_equal(a, b)
    assert [s["loss"] for s in steps] == [s["loss"] for s in plain_steps]
    # a micro-batch holds 2 rows on each of 4 dp groups: 8, the mean over micro-batches
    assert {s["rows"] for s in steps} == {8.0}
    assert all(0 < s["mae"] < 2 for s in steps) and len({s["mae"] for s in steps}) > 1
    examples = mlp_examples(64)
    assert logged.eval_loss(examples, 2) == plain.eval_loss(examples, 2)


@pytest.mark.parametrize("metrics, named", [
    ({"mae": jnp.zeros(3)}, "mae"), ({"loss": jnp.float32(0)}, "loss")])
def test_metrics_that_are_not_scalars_or_reuse_a_name_are_refused(tmp_path, metrics, named):
    def loss_fn(rng, state, params, batch, is_training):
        return mlp_loss(rng, state, params, batch, is_training), metrics
    with pytest.raises(ValueError, match=f"loss_fn's metrics must be scalars.*{named}"):
        train(str(tmp_path), loss_fn)
