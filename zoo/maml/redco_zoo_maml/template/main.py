"""{{project_name}}: MAML (Finn et al. 2017) on sinusoid regression, written as Redco's three
functions. ``python main.py`` meta-trains and prints the held-out MSE before and after one
adaptation step; ``--n_model_shards 2`` splits the MLP over (2 or more) devices as well.

Tasks are the examples: ``collate_fn`` stacks a meta-batch of them, ``loss_fn`` adapts to each
task's support set and scores its query set, ``pred_fn`` predicts after adapting. The task
sampler, the MLP and the inner step come from ``redco_zoo_maml``; change anything here."""
import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from redco import Deployer, Trainer
from redco_zoo_maml import SinusoidTasks, adapt, init_mlp, mlp, mse, query_mse


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
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save_every_n_steps", type=int, help="a step checkpoint every this "
                        "many updates (also on SIGTERM); a rerun resumes")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    train(**vars(parser.parse_args()))
