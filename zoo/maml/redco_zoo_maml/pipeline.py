"""MAML (Finn et al. 2017) on sinusoid regression through the three functions, and
``redco zoo run maml``. Tasks are the examples: a batch is a meta-batch of tasks."""
from __future__ import annotations

import argparse
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from redco import Deployer, Trainer
from redco_zoo_maml.plugin import DESCRIPTION


class SinusoidTasks(Sequence):
    """``n`` tasks ``y = A sin(x - phase)``, A ~ U[0.1, 5], phase ~ U[0, pi], x ~ U[-5, 5],
    each with ``k_support`` support and ``k_query`` query points (drawn once, from ``seed``)."""

    def __init__(self, n: int, seed: int, k_support: int = 10, k_query: int = 10):
        rng = np.random.default_rng(seed)
        amplitude, phase = rng.uniform(0.1, 5.0, (n, 1)), rng.uniform(0, np.pi, (n, 1))
        self.x = rng.uniform(-5.0, 5.0, (n, k_support + k_query)).astype(np.float32)
        self.y = (amplitude * np.sin(self.x - phase)).astype(np.float32)
        self.k = k_support

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        x, y, k = self.x[i], self.y[i], self.k
        return {"support_x": x[:k], "support_y": y[:k], "query_x": x[k:], "query_y": y[k:]}


def init_mlp(seed: int, sizes=(1, 40, 40, 1)) -> dict:
    """Params of a ReLU MLP, ``{"dense_i": {"kernel", "bias"}}``; kernels ~ U(+-1/sqrt(fan_in))
    as PyTorch's (He-scaled ones make the first inner steps overshoot)."""
    keys = jax.random.split(jax.random.PRNGKey(seed), len(sizes) - 1)
    return {f"dense_{i}": {"kernel": jax.random.uniform(key, (m, n), minval=-1, maxval=1) / np.sqrt(m),
                           "bias": jnp.zeros(n)}
            for i, (key, m, n) in enumerate(zip(keys, sizes[:-1], sizes[1:]))}


def mlp(params: dict, x: jax.Array) -> jax.Array:
    """The model (``apply_fn``): ``x`` (..., 1) -> (..., 1)."""
    for i in range(len(params)):
        layer = params[f"dense_{i}"]
        x = x @ layer["kernel"] + layer["bias"]
        x = jax.nn.relu(x) if i < len(params) - 1 else x
    return x


def mse(apply_fn, params, x, y) -> jax.Array:
    """Mean squared error of the model on ``(x, y)``."""
    return jnp.mean((apply_fn(params, x) - y) ** 2)


def adapt(apply_fn, params, x, y, inner_lr: float, first_order: bool = False):
    """One inner SGD step on a task's support set ``(x, y)``; ``first_order`` stops the
    gradient through the inner gradient (FOMAML)."""
    grads = jax.grad(mse, argnums=1)(apply_fn, params, x, y)
    if first_order:
        grads = jax.lax.stop_gradient(grads)
    return jax.tree.map(lambda p, g: p - inner_lr * g, params, grads)


def query_mse(tasks, preds) -> float:
    """Mean squared error of query predictions over ``tasks``."""
    return float(np.mean([(np.asarray(p) - t["query_y"][:, None]) ** 2
                          for t, p in zip(tasks, preds)]))


def collate_fn(tasks: list[dict]) -> dict:
    """Tasks -> arrays with a task axis: ``support_x`` (tasks, K, 1) and so on."""
    return {key: np.stack([t[key] for t in tasks])[..., None].astype(np.float32)
            for key in tasks[0]}


def loss_fn(rng, state, params, batch, is_training, inner_lr=0.01, first_order=False):
    """The meta-loss: mean query MSE of the tasks after adapting to their support sets,
    differentiated through the inner step (second order) unless ``first_order``."""
    def task_loss(task):
        fast = adapt(state.apply_fn, params, task["support_x"], task["support_y"], inner_lr,
                     first_order)
        return mse(state.apply_fn, fast, task["query_x"], task["query_y"])
    return jnp.mean(jax.vmap(task_loss)(batch))


def pred_fn(rng, params, batch, apply_fn=mlp, inner_lr=0.01):
    """Each task's query predictions after adaptation (``inner_lr=0``: before it)."""
    def predict(task):
        fast = adapt(apply_fn, params, task["support_x"], task["support_y"], inner_lr)
        return apply_fn(fast, task["query_x"])
    return jax.vmap(predict)(batch)


def train(n_meta_iterations: int = 3000, meta_batch_size: int = 64, meta_lr: float = 5e-3,
          inner_lr: float = 0.01, first_order: bool = False, n_eval_tasks: int = 1000,
          n_model_shards: int = 1, workdir: str = "./workdir", seed: int = 0,
          save_every_n_steps: int | None = None) -> dict:
    """Meta-train on fresh tasks (training losses go to ``workdir/metrics.jsonl``; a step
    checkpoint every ``save_every_n_steps`` updates and on SIGTERM, from which a rerun resumes);
    return the MSE on held-out tasks' query points before and after adapting to their support
    points."""
    deployer = Deployer(jax_seed=seed, n_model_shards=n_model_shards, workdir=workdir)
    if meta_batch_size % deployer.dp_size:
        raise ValueError(f"meta_batch_size {meta_batch_size} does not divide among "
                         f"{deployer.dp_size} data-parallel devices: pick a multiple of "
                         f"{deployer.dp_size}.")
    per_device = meta_batch_size // deployer.dp_size
    train_tasks = SinusoidTasks(n_meta_iterations * meta_batch_size, seed=seed)
    held_out = SinusoidTasks(n_eval_tasks, seed=seed + 1)
    params = init_mlp(seed)
    rules = deployer.get_sharding_rules(params, trace_fn=lambda p: mlp(p, jnp.zeros((1, 1))))
    trainer = Trainer(deployer, collate_fn, mlp,
                      functools.partial(loss_fn, inner_lr=inner_lr, first_order=first_order),
                      params, optax.adam(meta_lr), params_sharding_rules=rules)
    trainer.fit(train_tasks, per_device, n_epochs=1, save_every_n_steps=save_every_n_steps)
    results = {}
    for name, lr in (("pre", 0.0), ("post", inner_lr)):
        predictor = trainer.get_default_predictor(functools.partial(pred_fn, inner_lr=lr))
        results[f"{name}_adaptation_mse"] = query_mse(
            held_out, predictor.predict(held_out, per_device, trainer.params))
    deployer.log_info(f"{len(held_out)} held-out tasks: pre-adaptation MSE "
                      f"{results['pre_adaptation_mse']:.4f}, post-adaptation MSE "
                      f"{results['post_adaptation_mse']:.4f}")
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command line: ``train``'s parameters as flags."""
    parser.add_argument("--n_meta_iterations", type=int, default=3000)
    parser.add_argument("--meta_batch_size", type=int, default=64, help="tasks per update "
                        "(all devices together)")
    parser.add_argument("--meta_lr", type=float, default=5e-3, help="Adam learning rate")
    parser.add_argument("--inner_lr", type=float, default=0.01)
    parser.add_argument("--first_order", action="store_true", help="FOMAML")
    parser.add_argument("--n_eval_tasks", type=int, default=1000)
    parser.add_argument("--n_model_shards", type=int, default=1)
    parser.add_argument("--workdir", default="./workdir")
    parser.add_argument("--jax_seed", "--seed", dest="seed", type=int, default=0,
                        help="seeds jax and the data (train's seed)")
    parser.add_argument("--save_every_n_steps", type=int, help="a step checkpoint every this "
                        "many updates (also on SIGTERM); a rerun resumes")


class MAMLPipeline:
    description = DESCRIPTION

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_arguments(parser)

    def run(self, args: argparse.Namespace) -> dict:
        return train(**vars(args))
