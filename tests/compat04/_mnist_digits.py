"""The MNIST stand-in shared by test_mnist.py and test_differential_private_training.py.

Both 0.4.x examples train a small CNN on torchvision's MNIST. Here the data is sklearn's 8x8
digits (1,797 images, no download), stored the way the examples build their examples from
torchvision: ``{'image': uint8 array (H, W), 'label': int}``. The user functions below are the
examples' own (the same signatures and arguments Redco 0.4 calls them with), written anew: a CNN,
``collate_fn``, ``loss_fn(rng, state, params, batch, is_training)``, ``pred_fn(rng, params, batch,
model)`` and ``eval_metric_fn(examples, preds)``; ``eval_metric_fn`` also keeps each result in
``EVAL_RESULTS`` so a test can read what ``fit`` evaluated.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from sklearn.datasets import load_digits

N_TEST = 360
EVAL_RESULTS: list[dict] = []


def load_dataset() -> dict[str, list[dict]]:
    """``{'train': [...], 'test': [...]}`` of ``{'image', 'label'}``: pixels scaled to 0..240 as
    uint8, like the PIL images of MNIST; a fixed shuffle, then the last ``N_TEST`` are the test set."""
    digits = load_digits()
    images = (digits.images * 15).astype(np.uint8)
    order = np.random.default_rng(0).permutation(len(images))
    examples = [{'image': images[i], 'label': int(digits.target[i])} for i in order]
    return {'train': examples[:-N_TEST], 'test': examples[-N_TEST:]}


class CNN(nn.Module):
    """Two conv + average-pool blocks and a two-layer head, as in the examples (sized for 8x8)."""
    hidden: int = 256
    hidden_dtype: jnp.dtype | None = None

    @nn.compact
    def __call__(self, x):
        for features in (32, 64):
            x = nn.relu(nn.Conv(features=features, kernel_size=(3, 3))(x))
            x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(features=self.hidden, dtype=self.hidden_dtype)(x))
        return nn.Dense(features=10)(x)


def collate_fn(examples):
    images = np.stack([np.asarray(example['image'])[:, :, None] for example in examples])
    labels = np.array([example['label'] for example in examples])
    return {'images': images, 'labels': labels}


def loss_fn(rng, state, params, batch, is_training):
    logits = state.apply_fn({'params': params}, batch['images'])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits=logits, labels=batch['labels']).mean()


def pred_fn(rng, params, batch, model):
    return model.apply({'params': params}, batch['images']).argmax(axis=-1)


def eval_metric_fn(examples, preds):
    labels = np.array([example['label'] for example in examples])
    result = {'acc': np.mean(np.array(preds) == labels).item()}
    EVAL_RESULTS.append({'n_examples': len(examples), **result})
    return result
