"""tanyuqian/redco ``examples/mnist/main.py`` (the 0.4.16-0.4.23 version), run unchanged in its
Redco calls on sklearn's digits (see _mnist_digits.py) and 8 simulated devices.

The example's README runs it as ``main.py --n_model_shards 2``; both that and the default
``n_model_shards=1`` (data parallel only, where 0.4's ``get_sharding_rules`` returns None) run here.
``main`` below makes the example's calls, with the same keywords, in the same order:

1. ``Deployer(jax_seed=, workdir='./workdir', n_model_shards=)``
2. ``deployer.gen_rng()`` as the key of ``model.init``
3. ``deployer.get_sharding_rules(params_shape_or_params=params)``; when not None,
   ``deployer.log_info(info='\\n'.join(str(rule) ...), title='Sharding rules')``
4. ``Trainer(deployer=, collate_fn=, apply_fn=model.apply, loss_fn=, params=,
   optimizer=optax.adamw(learning_rate=), params_sharding_rules=)``
5. ``Predictor(deployer=, collate_fn=, pred_fn=partial(pred_fn, model=model),
   params_sharding_rules=)``
6. ``trainer.fit(train_examples=, per_device_batch_size=, n_epochs=, eval_examples=,
   eval_predictor=, eval_metric_fn=)``

It returns the trainer (the example returns nothing) so the test can read ``trainer.step``.
"""
from functools import partial

import jax
import optax
import pytest
from _mnist_digits import (
    CNN,
    EVAL_RESULTS,
    N_TEST,
    collate_fn,
    eval_metric_fn,
    load_dataset,
    loss_fn,
    pred_fn,
)

from redco import Deployer, Predictor, Trainer

# Measured, test accuracy after 3 epochs (n_model_shards=2 / 1): Redco 0.4.23 0.89 / 0.93, this package
# 0.96 / 0.88; chance is 0.10 (0.4's sanity check, before training, measured 0.16-0.19).
ACC_BAR = 0.75


def main(per_device_batch_size=8, learning_rate=1e-3, n_epochs=3, jax_seed=42, n_model_shards=1):
    deployer = Deployer(jax_seed=jax_seed, workdir='./workdir', n_model_shards=n_model_shards)

    dataset = load_dataset()

    model = CNN()
    dummy_batch = collate_fn(examples=[dataset['train'][0]])
    params = model.init(deployer.gen_rng(), dummy_batch['images'])['params']

    params_sharding_rules = deployer.get_sharding_rules(params_shape_or_params=params)
    if params_sharding_rules is not None:
        deployer.log_info(
            info='\n'.join([str(t) for t in params_sharding_rules]), title='Sharding rules')

    trainer = Trainer(
        deployer=deployer,
        collate_fn=collate_fn,
        apply_fn=model.apply,
        loss_fn=loss_fn,
        params=params,
        optimizer=optax.adamw(learning_rate=learning_rate),
        params_sharding_rules=params_sharding_rules)

    predictor = Predictor(
        deployer=deployer,
        collate_fn=collate_fn,
        pred_fn=partial(pred_fn, model=model),
        params_sharding_rules=params_sharding_rules)

    trainer.fit(
        train_examples=dataset['train'],
        per_device_batch_size=per_device_batch_size,
        n_epochs=n_epochs,
        eval_examples=dataset['test'],
        eval_predictor=predictor,
        eval_metric_fn=eval_metric_fn)
    return trainer


@pytest.mark.parametrize('n_model_shards', [2, 1])
def test_mnist_example_learns_digits(n_model_shards):
    EVAL_RESULTS.clear()
    per_device_batch_size, n_epochs = 8, 3
    trainer = main(per_device_batch_size=per_device_batch_size, n_epochs=n_epochs,
                   n_model_shards=n_model_shards)

    # 0.4's batch: per_device_batch_size on each of the dp = 8 / n_model_shards data-parallel
    # groups; the last partial batch of an epoch is dropped.
    n_train = len(load_dataset()['train'])
    global_batch_size = per_device_batch_size * jax.device_count() // n_model_shards
    assert trainer.step == n_epochs * (n_train // global_batch_size)

    # eval_metric_fn saw the whole test set after every epoch (plus 0.4's sanity check on the
    # first global batch, before training), and the model learned.
    full = [r['acc'] for r in EVAL_RESULTS if r["n_examples"] == N_TEST]
    assert len(full) == n_epochs, EVAL_RESULTS
    assert full[-1] > ACC_BAR, full

    log = open('workdir/log.txt').read()
    if n_model_shards > 1:  # 0.4 returns rules only when the model is sharded
        assert 'Sharding rules' in log
