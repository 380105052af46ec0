"""Gradient accumulation equals one big batch; the schedule ends exactly at the last update."""
import jax
import numpy as np
import optax
from helpers import Recorder, mlp_apply, mlp_collate, mlp_examples, mlp_init, mlp_loss

from redco import Deployer, Trainer


def run(workdir, per_device_batch_size, accumulate, schedule=None, n_epochs=1, optimizer=None):
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=workdir, verbose=False)
    recorder = Recorder()
    trainer = Trainer(deployer, mlp_collate, mlp_apply, mlp_loss, mlp_init(),
                      optimizer or optax.sgd(schedule or 0.1), lr_schedule_fn=schedule,
                      accumulate_grad_batches=accumulate, callbacks=[recorder])
    trainer.fit(mlp_examples(64), per_device_batch_size, n_epochs=n_epochs)
    return recorder, jax.device_get(trainer.params), trainer


def test_accumulating_4_micro_batches_equals_one_batch_4x(workdir):
    rec_acc, acc, _ = run(workdir + "a", per_device_batch_size=2, accumulate=4)
    rec_big, big, _ = run(workdir + "b", per_device_batch_size=8, accumulate=1)
    assert len(rec_acc.losses) == len(rec_big.losses) == 2  # 64 examples / (4 dp * 8)
    np.testing.assert_allclose(rec_acc.losses, rec_big.losses, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(acc), jax.tree.leaves(big)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_optax_multisteps_wrapper_is_not_applied_twice(workdir):
    _, plain, _ = run(workdir + "a", 2, 4, optimizer=optax.sgd(0.1))
    _, wrapped, _ = run(workdir + "b", 2, 4, optimizer=optax.MultiSteps(optax.sgd(0.1), 4))
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(wrapped)):
        np.testing.assert_array_equal(a, b)


def test_schedule_counts_updates_and_ends_at_last_update(workdir):
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=workdir, verbose=False)
    for schedule_type in ("linear", "cosine"):
        schedule = deployer.get_lr_schedule_fn(
            train_size=64, per_device_batch_size=2, n_epochs=3, learning_rate=0.1,
            schedule_type=schedule_type, warmup_rate=0.2, end_learning_rate=0.01,
            accumulate_grad_batches=2)
        lrs = []

        class LrRecorder(Recorder):
            def on_step_end(self, trainer, step, metrics):
                lrs.append(metrics["lr"])
        LrRecorder.on_step_end = __import__("redco").hookimpl(LrRecorder.on_step_end)
        deployer_run = Deployer(jax_seed=0, n_model_shards=2, workdir=workdir + schedule_type,
                                verbose=False)
        trainer = Trainer(deployer_run, mlp_collate, mlp_apply, mlp_loss, mlp_init(),
                          optax.sgd(schedule), lr_schedule_fn=schedule,
                          accumulate_grad_batches=2, callbacks=[LrRecorder()])
        trainer.fit(mlp_examples(64), 2, n_epochs=3)
        assert len(lrs) == 3 * (64 // (2 * 4 * 2)) == schedule.total_steps
        assert max(lrs) == np.float32(0.1)
        np.testing.assert_allclose(lrs[-1], 0.01, rtol=1e-6)  # exactly the end value
        assert lrs[-2] > 0.01


def test_a_jitted_schedule_ends_at_zero_never_below():
    """Computed inside the jitted step, linear decay to 0 ended at -4e-11 at the last update
    (XLA's fused arithmetic): a negative learning rate, however small, steps uphill."""
    deployer = Deployer(jax_seed=0, n_model_shards=2, verbose=False)
    for schedule_type in ("linear", "cosine"):
        for total in (12, 37, 158):
            schedule = deployer.get_lr_schedule_fn(
                train_size=total * 4, per_device_batch_size=1, n_epochs=1, learning_rate=3e-3,
                schedule_type=schedule_type, warmup_rate=0.1)
            lrs = np.asarray(jax.jit(jax.vmap(schedule))(np.arange(total + 1)))
            assert lrs.min() == 0 and lrs[total - 1] == 0, (schedule_type, total, lrs[-3:])
            assert lrs.max() == np.float32(3e-3)


def test_a_max_steps_schedule_is_counted_in_those_updates_whatever_the_data():
    """``fit(max_steps=N)`` trains N updates: the schedule given ``max_steps=N`` reaches its end
    value at update N - 1, with data for far more (or fewer) updates than that."""
    deployer = Deployer(jax_seed=0, n_model_shards=2, verbose=False)
    for train_size in (3, 40_000):
        schedule = deployer.get_lr_schedule_fn(
            train_size=train_size, per_device_batch_size=1, n_epochs=5, learning_rate=1e-3,
            warmup_steps=2, end_learning_rate=1e-5, max_steps=10)
        lrs = np.asarray(jax.jit(jax.vmap(schedule))(np.arange(12)))
        assert np.isclose(lrs[2], 1e-3) and lrs[8] > np.float32(1e-5), lrs
        assert (lrs[9:] == np.float32(1e-5)).all(), lrs
