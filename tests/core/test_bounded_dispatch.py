"""Evaluation at corpus scale: a few steps in flight at most (``redco/in_flight.py``), and
``fit(max_eval_batches=)`` bounding what each evaluation reads, said in the log."""
import json
import os

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import mlp_apply, mlp_collate, mlp_examples, mlp_init, mlp_loss

from redco import Deployer, Trainer
from redco.in_flight import read_in_order


def make_trainer(workdir, n_model_shards=2):
    deployer = Deployer(jax_seed=0, n_model_shards=n_model_shards, workdir=workdir,
                        verbose=False)
    return Trainer(deployer, mlp_collate, mlp_apply, mlp_loss, mlp_init(), optax.adam(1e-2))


@pytest.mark.parametrize("max_in_flight", [1, 2, 3])
def test_read_in_order_keeps_order_and_never_more_than_its_bound_unread(max_in_flight):
    unread, most = set(), 0

    def dispatched():
        nonlocal most
        for i in range(10):
            unread.add(i)
            most = max(most, len(unread))
            yield i

    def read(i):
        unread.remove(i)
        return i * i

    assert list(read_in_order(dispatched(), read, max_in_flight)) == [i * i for i in range(10)]
    assert most == max_in_flight
    with pytest.raises(ValueError, match="max_in_flight=0"):
        list(read_in_order(dispatched(), read, 0))


def test_an_evaluation_of_thousands_of_batches_finishes(workdir):
    """2,000 batches over dp 4 x mp 2, each step longer than its dispatch: dispatched all at
    once, XLA:CPU's all-reduce rendezvous gave up after 40 s and aborted the process (issue
    43's repro: 525 batches of an LM)."""
    def collate(rows):
        return {"x": np.stack([r["x"] for r in rows])}

    def loss(rng, state, params, batch, is_training):
        return jnp.mean(jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"])

    params = {"w1": jnp.full((64, 256), 0.01), "w2": jnp.full((256, 8), 0.01)}
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=workdir, verbose=False)
    trainer = Trainer(deployer, collate, None, loss, params, optax.sgd(0.1))
    pattern = [{"x": np.full(64, i, np.float32)} for i in range(8)]  # one global batch
    mean_loss = trainer.eval_loss(pattern * 2000, 1)
    assert mean_loss == pytest.approx(trainer.eval_loss(pattern, 1), rel=1e-5)


def test_fit_evaluates_the_first_max_eval_batches_and_says_so(workdir):
    trainer = make_trainer(workdir)
    evaluate = mlp_examples(100, seed=1)  # 8 rows a global batch (dp 4 x 2): 13 batches
    trainer.fit(mlp_examples(64), per_device_batch_size=2, n_epochs=1, eval_examples=evaluate,
                max_eval_batches=3)
    with open(os.path.join(workdir, "eval_results_epoch0.json")) as f:
        logged = json.load(f)["loss"]
    first_three = trainer.eval_loss(evaluate[:24], 2)
    assert abs(logged - first_three) < 1e-6
    assert abs(logged - trainer.eval_loss(evaluate, 2)) > 1e-4  # (so the cut changed it)
    assert trainer.eval_loss(evaluate, 2, max_batches=3) == first_three
    with open(os.path.join(workdir, "log.txt")) as f:
        log = f.read()
    assert "Evaluating on the first 24 of 100 eval examples: 3 batches of 8" in log


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_a_max_eval_batches_that_is_not_a_positive_count_is_refused_first(workdir, bad):
    trainer = make_trainer(workdir)
    with pytest.raises((ValueError, TypeError), match="max_eval_batches"):
        trainer.fit(mlp_examples(64), per_device_batch_size=2, n_epochs=1,
                    eval_examples=mlp_examples(16), max_eval_batches=bad)
    assert trainer.step == 0 and not os.path.exists(os.path.join(workdir, "ckpts"))
