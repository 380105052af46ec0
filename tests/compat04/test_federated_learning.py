"""Redco 0.4.x script: tanyuqian/redco ``examples/faderated_learning/main.py`` (FedAvg; with its
``data_utils.py`` and ``model_utils.py``; the newest stored version, the one resetting one
Trainer per client with ``set_train_state``), with sklearn's 8x8 digits standing in for MNIST:
1437 training images split among 10 clients (IID, the README's ``--do_iid_partition``; the
non-IID split by label shards is there too), 360 held out for the server's test.

Redco calls reproduced, with the original's keywords and use of the results:

- ``Deployer(jax_seed=, verbose=False)``, then ``deployer.gen_rng()`` for ``model.init``
- ``Trainer(deployer=, collate_fn=, apply_fn=model.apply, loss_fn=, params=,
  optimizer=optax.adam(learning_rate=0.))`` - one for all clients, made by the server
- ``Predictor(deployer=, collate_fn=, pred_fn=partial(pred_fn, model=),
  output_fn=lambda x: x.tolist())``
- per client: ``trainer.set_train_state(apply_fn=, params=<server params, a FrozenDict>,
  optimizer=optax.adam(learning_rate=), step=0)``, ``trainer.fit(train_examples=,
  per_device_batch_size=, n_epochs=)``, then ``trainer.params`` summed into the server average
- per round: ``predictor.predict(examples=, per_device_batch_size=, params=<server params>)``

and Redco calling back ``loss_fn(train_rng, state, params, batch, is_training)`` (through
``state.apply_fn``) and ``pred_fn(pred_rng, batch, params)``.
"""
import time
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.core.frozen_dict import freeze
from sklearn.datasets import load_digits
from sklearn.metrics import confusion_matrix

from redco import Deployer, Predictor, Trainer


# ---- data_utils -----------------------------------------------------------------------------
def get_dataset(n_clients, n_data_shards, do_iid_partition, seed=0):
    """Clients' training examples and the test examples. IID: a random equal split; non-IID:
    each label's examples cut into ``n_data_shards / 10`` shards, ``n_data_shards / n_clients``
    random shards per client."""
    digits = load_digits()
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(digits.images))
    examples = [{'image': (digits.images[i] / 16.).astype(np.float32)[..., None],
                 'label': int(digits.target[i])} for i in order]
    train, test = examples[:1437], examples[1437:]

    if do_iid_partition:
        client_idxes = np.array_split(rng.permutation(len(train)), n_clients)
    else:
        data_shards = [idxes for label in range(10) for idxes in np.array_split(
            [i for i, e in enumerate(train) if e['label'] == label], n_data_shards // 10)]
        client_idxes = [np.concatenate([data_shards[s] for s in shards])
                        for shards in rng.permutation(n_data_shards).reshape(n_clients, -1)]
    client_train_datasets = {client: [train[i] for i in idxes]
                             for client, idxes in enumerate(client_idxes)}
    return client_train_datasets, test


# ---- model_utils ----------------------------------------------------------------------------
class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(features=16, kernel_size=(3, 3))(x))
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nn.relu(nn.Dense(features=64)(x.reshape((x.shape[0], -1))))
        return nn.Dense(features=10)(x)


def collate_fn(examples):
    return {'images': np.stack([example['image'] for example in examples]),
            'labels': np.stack([example['label'] for example in examples])}


def loss_fn(train_rng, state, params, batch, is_training):
    logits = state.apply_fn({'params': params}, batch['images'])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits=logits, labels=batch['labels']).mean()


def pred_fn(pred_rng, batch, params, model):
    return model.apply({'params': params}, batch['images']).argmax(axis=-1)


# ---- main -----------------------------------------------------------------------------------
class FedAvgServer:
    def __init__(self, deployer, model, params, n_clients):
        self._deployer = deployer
        self._model = model
        self._params = freeze(params)
        self._n_clients = n_clients

        self._trainer = Trainer(
            deployer=self._deployer,
            collate_fn=collate_fn,
            apply_fn=self._model.apply,
            loss_fn=loss_fn,
            params=params,
            optimizer=optax.adam(learning_rate=0.))

        self._predictor = Predictor(
            deployer=self._deployer,
            collate_fn=collate_fn,
            pred_fn=partial(pred_fn, model=self._model),
            output_fn=lambda x: x.tolist())

    def train_client(self, examples, learning_rate, per_device_batch_size, n_epochs):
        self._trainer.set_train_state(
            apply_fn=self._model.apply,
            params=self._params,
            optimizer=optax.adam(learning_rate=learning_rate),
            step=0)

        self._trainer.fit(
            train_examples=examples,
            per_device_batch_size=per_device_batch_size,
            n_epochs=n_epochs)

        return self._trainer.params

    def test(self, examples, per_device_batch_size):
        preds = self._predictor.predict(
            examples=examples,
            per_device_batch_size=per_device_batch_size,
            params=self._params)
        labels = [example['label'] for example in examples]

        acc = np.mean(np.array(preds) == np.array(labels))
        conf_mat = confusion_matrix(y_true=labels, y_pred=preds, labels=list(range(10)))
        return acc, conf_mat

    def run(self, n_rounds, n_clients_per_round, n_client_epochs_per_round, per_device_batch_size,
            eval_per_device_batch_size, learning_rate, client_train_datasets, eval_dataset):
        history = []
        for round_idx in range(n_rounds):
            round_client_idxes = np.random.choice(
                np.arange(self._n_clients), n_clients_per_round, replace=False)

            sum_client_params = jax.tree_util.tree_map(jnp.zeros_like, self._params)
            for client_idx in round_client_idxes:
                client_params = self.train_client(
                    examples=client_train_datasets[client_idx],
                    learning_rate=learning_rate,
                    per_device_batch_size=per_device_batch_size,
                    n_epochs=n_client_epochs_per_round)
                sum_client_params = jax.tree_util.tree_map(
                    lambda x, y: x + y, sum_client_params, client_params)

            self._params = jax.tree_util.tree_map(
                lambda x: x / n_clients_per_round, sum_client_params)

            acc, conf_mat = self.test(
                examples=eval_dataset, per_device_batch_size=eval_per_device_batch_size)
            print(f'Round {round_idx}: test accuracy {acc:.3f}')
            history.append((acc, conf_mat))
        return history


def test_fedavg_digits():
    start = time.perf_counter()
    np.random.seed(0)  # the original samples each round's clients with np.random
    n_clients, per_device_batch_size, learning_rate = 10, 4, 3e-3
    # The README's --do_iid_partition: the non-IID split needs many more rounds (0.42-0.69
    # after 5-8 rounds in a plain-JAX run of the same settings) than a test can afford.
    client_train_datasets, eval_dataset = get_dataset(
        n_clients=n_clients, n_data_shards=20, do_iid_partition=True)

    deployer = Deployer(jax_seed=42, verbose=False)
    model = CNN()
    dummy_batch = collate_fn([eval_dataset[0]])
    params = model.init(deployer.gen_rng(), dummy_batch['images'])['params']

    server = FedAvgServer(deployer=deployer, model=model, params=params, n_clients=n_clients)
    history = server.run(
        n_rounds=5, n_clients_per_round=5, n_client_epochs_per_round=2,
        per_device_batch_size=per_device_batch_size, eval_per_device_batch_size=16,
        learning_rate=learning_rate, client_train_datasets=client_train_datasets,
        eval_dataset=eval_dataset)
    elapsed = time.perf_counter() - start

    # The initial params' accuracy, without Redco: the run must rise far above it.
    labels = np.array([e['label'] for e in eval_dataset])
    before = np.mean(np.asarray(pred_fn(None, collate_fn(eval_dataset), params, model)) == labels)
    accs = [acc for acc, _ in history]
    print(f"FedAvg, 10 IID clients, 5 per round: test accuracy {before:.3f} "
          f"before, per round {[round(float(a), 3) for a in accs]}; {elapsed:.1f} s")
    acc, conf_mat = history[-1]
    assert conf_mat.sum() == len(eval_dataset) and np.trace(conf_mat) == round(acc * len(eval_dataset))
    # Chance is 0.1; redco 0.4.23 reached 0.83 here.
    assert acc >= 0.75 and acc >= before + 0.5, (before, accs)

    # set_train_state really restarts a client from the given params and step: the same client
    # trained twice from the server's params (one full batch of 32, so the order of examples
    # cannot matter) gives the same params, one Adam step away from the server's.
    global_batch_size = per_device_batch_size * jax.device_count()
    client = client_train_datasets[0][:global_batch_size]
    first = jax.device_get(server.train_client(client, learning_rate, per_device_batch_size, 1))
    assert server._trainer.step == 1
    second = jax.device_get(server.train_client(client, learning_rate, per_device_batch_size, 1))
    assert server._trainer.step == 1
    gaps = [float(np.abs(np.asarray(a) - np.asarray(b)).max())
            for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second))]
    moved = [float(np.abs(np.asarray(a) - np.asarray(b)).max())
             for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(jax.device_get(server._params)))]
    assert max(gaps) <= 1e-6 and min(moved) >= 0.5 * learning_rate, (gaps, moved)
