"""``Trainer.train_scanned`` runs the updates of several epochs as one compiled call and ends
where ``train_epoch`` called per epoch ends: the same losses step by step and the same params,
data-parallel and tensor-parallel, with micro-batches, and with a stochastic loss (its
randomness drawn per step as ``train_epoch`` draws it)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import Recorder, lm_examples, lm_model, mlp_apply, mlp_collate, mlp_examples, mlp_init

from redco import Deployer, Trainer
from redco_zoo_lm import collate_fn as lm_collate
from redco_zoo_lm import loss_fn as lm_loss


def noisy_mlp_loss(rng, state, params, batch, is_training):
    """The MLP's squared error on inputs with noise from ``rng`` (different every step)."""
    x = batch["x"] + 0.1 * jax.random.normal(rng, batch["x"].shape)
    return jnp.mean((state.apply_fn(params, x) - batch["y"]) ** 2)


def trainer_for(case, n_model_shards, accumulate):
    deployer = Deployer(jax_seed=0, n_model_shards=n_model_shards, verbose=False)
    if case == "mlp":
        parts = mlp_apply, mlp_init(), mlp_collate, noisy_mlp_loss, mlp_examples(52)
    else:
        (apply_fn, params), examples = lm_model(), lm_examples(36)
        parts = apply_fn, params, lm_collate, lm_loss, examples
    apply_fn, params, collate, loss, examples = parts
    recorder = Recorder()
    trainer = Trainer(deployer, collate, apply_fn, loss, params, optax.adamw(1e-2),
                      accumulate_grad_batches=accumulate, callbacks=[recorder])
    return trainer, recorder, examples


@pytest.mark.parametrize("case, n_model_shards, accumulate", [
    pytest.param("mlp", 1, 1, marks=pytest.mark.slow), ("mlp", 1, 2), ("lm", 2, 1)])
def test_scanned_updates_equal_the_epochs_run_one_by_one(case, n_model_shards, accumulate):
    """(mlp-1-1 is slow: mlp-1-2 runs the stochastic MLP loss, lm-2-1 the scan without
    micro-batches, in CI.)"""
    one_by_one, recorded, examples = trainer_for(case, n_model_shards, accumulate)
    per_device = 8 // one_by_one.deployer.dp_size
    for epoch in range(3):  # 52 or 36 examples: a partial last batch left out each epoch
        one_by_one.train_epoch(examples, per_device, epoch)
    scanned, recorded_scanned, _ = trainer_for(case, n_model_shards, accumulate)
    scanned.train_scanned(examples, per_device, range(3))
    assert scanned.step == one_by_one.step == 3 * (len(examples) // (8 * accumulate))
    np.testing.assert_allclose(recorded_scanned.losses, recorded.losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(jax.device_get(scanned.params)),
                    jax.tree.leaves(jax.device_get(one_by_one.params))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    scanned.train_scanned(examples, per_device, range(3, 4))  # compiled once, run again
    assert scanned.step == 4 * (len(examples) // (8 * accumulate))
