"""{{project_name}}: a model trained by Redco from three functions. Run: python main.py

Replace the model, the data and the three functions with yours; Redco does the rest (data and
model parallelism from ``n_model_shards``, multi-host runs, checkpoints, logs, randomness).
"""
import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

from redco import Deployer, Trainer


def init_params(seed: int = 0, width: int = 64) -> dict:
    keys = jax.random.split(jax.random.PRNGKey(seed), 2)
    return {"hidden": {"kernel": jax.random.normal(keys[0], (1, width)), "bias": jnp.zeros(width)},
            "out": {"kernel": jax.random.normal(keys[1], (width, 1)) / np.sqrt(width),
                    "bias": jnp.zeros(1)}}


def apply_fn(params, x):
    h = jnp.tanh(x @ params["hidden"]["kernel"] + params["hidden"]["bias"])
    return h @ params["out"]["kernel"] + params["out"]["bias"]


def collate_fn(examples: list[dict]) -> dict:
    """Raw examples -> a batch of arrays (leading dim = batch)."""
    return {"x": np.array([[e["x"]] for e in examples], np.float32),
            "y": np.array([[e["y"]] for e in examples], np.float32)}


def loss_fn(rng, state, params, batch, is_training):
    """A batch -> a scalar loss."""
    return jnp.mean((state.apply_fn(params, batch["x"]) - batch["y"]) ** 2)


def pred_fn(rng, params, batch):
    """A batch -> predictions (leading dim = batch)."""
    return apply_fn(params, batch["x"])[:, 0]


def make_examples(n: int, seed: int) -> list[dict]:
    x = np.random.default_rng(seed).uniform(-3, 3, n)
    return [{"x": a, "y": np.sin(a)} for a in x]


def main(n_model_shards: int = 1, n_epochs: int = 20, workdir: str = "./workdir") -> float:
    """Train, then return the eval loss."""
    deployer = Deployer(jax_seed=42, n_model_shards=n_model_shards, workdir=workdir)
    train, evaluate = make_examples(2048, seed=0), make_examples(256, seed=1)
    lr = deployer.get_lr_schedule_fn(len(train), 8, n_epochs, 1e-2, warmup_rate=0.05)
    trainer = Trainer(deployer=deployer, collate_fn=collate_fn, apply_fn=apply_fn,
                      loss_fn=loss_fn, params=init_params(), optimizer=optax.adam(lr),
                      lr_schedule_fn=lr)
    predictor = trainer.get_default_predictor(pred_fn=pred_fn)
    trainer.fit(train, per_device_batch_size=8, n_epochs=n_epochs, eval_examples=evaluate,
                eval_predictor=predictor, save_every_n_steps=200,
                save_argmin_ckpt_by_metrics=["loss"])
    return trainer.eval_loss(evaluate, per_device_batch_size=8)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n_model_shards", type=int, default=1)
    parser.add_argument("--n_epochs", type=int, default=20)
    parser.add_argument("--workdir", default="./workdir")
    args = parser.parse_args()
    print(f"eval loss: {main(args.n_model_shards, args.n_epochs, args.workdir):.4f}")
