"""Two tiny models with their data (an MLP regression, a LLaMA-style LM) and a recording
plugin. Imported by tests after conftest.py has set up the simulated devices."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import redco
from redco import Deployer, Trainer
from redco_zoo_lm import collate_fn as lm_collate
from redco_zoo_lm import loss_fn as lm_loss
from redco_zoo_models import LlamaConfig, LlamaForCausalLM, split_model


# ---- an MLP with 12 layers (so Dense_10 comes after Dense_9) -------------------------------
def mlp_init(seed=0, width=16, n_layers=12):
    keys = jax.random.split(jax.random.PRNGKey(seed), n_layers)
    dims = [8] + [width] * (n_layers - 1) + [1]
    return {f"Dense_{i}": {"kernel": jax.random.normal(keys[i], (dims[i], dims[i + 1]))
                           / np.sqrt(dims[i]), "bias": jnp.zeros(dims[i + 1])}
            for i in range(n_layers)}


def mlp_apply(params, x):
    n = len(params)
    for i in range(n):
        x = x @ params[f"Dense_{i}"]["kernel"] + params[f"Dense_{i}"]["bias"]
        x = jax.nn.tanh(x) if i < n - 1 else x
    return x


def mlp_examples(n=128, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    y = np.sin(x.sum(1, keepdims=True)).astype(np.float32)
    return [{"x": a, "y": b} for a, b in zip(x, y)]


def mlp_collate(examples):
    return {"x": np.stack([e["x"] for e in examples]), "y": np.stack([e["y"] for e in examples])}


def mlp_loss(rng, state, params, batch, is_training):
    return jnp.mean((state.apply_fn(params, batch["x"]) - batch["y"]) ** 2)


# ---- a tiny LLaMA-style LM on a repeating byte pattern ----------------------------------------
# (its layers one by one: core's tests read per-layer names; stacked: tests/zoo/test_scan_*)
LM_CONFIG = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, scan_layers=False)


@nnx.jit
def drawn_lm(key):
    return LlamaForCausalLM(LM_CONFIG, rngs=nnx.Rngs(key))


def lm_model(seed=0):
    """A 2-layer LLaMA's ``(apply_fn, params)``, its parameters drawn by one compiled program
    (``drawn_lm``, traced once per process): built eagerly, each parameter shape's initializer
    compiles on its own (1.0 -> 0.65 CPU s in a fresh process; the worker processes of
    tests/multihost build it in every run)."""
    return split_model(drawn_lm(jax.random.key(seed)))


def lm_examples(n=64, seq_len=16, seed=0):
    rng = np.random.default_rng(seed)
    return [{"token_ids": (np.arange(seq_len + 1) * rng.integers(1, 4) + rng.integers(32)) % 32}
            for _ in range(n)]


class Recorder:
    """A per-run plugin that records every lifecycle hook call."""

    def __init__(self):
        self.calls, self.losses, self.eval_losses = [], [], []

    @redco.hookimpl
    def on_fit_start(self, trainer, n_epochs, steps_per_epoch):
        self.calls.append("on_fit_start")

    @redco.hookimpl
    def on_step_end(self, trainer, step, metrics):
        self.calls.append("on_step_end")
        self.losses.append(metrics["loss"])

    @redco.hookimpl
    def on_eval_end(self, trainer, epoch, metrics):
        self.calls.append("on_eval_end")
        self.eval_losses.append(metrics.get("loss"))

    @redco.hookimpl
    def on_checkpoint_saved(self, trainer, path, step):
        self.calls.append("on_checkpoint_saved")

    @redco.hookimpl
    def on_fit_end(self, trainer):
        self.calls.append("on_fit_end")

    @redco.hookimpl
    def state_to_save(self, trainer, step):
        self.calls.append("state_to_save")
        return {"recorder_steps": self.calls.count("on_step_end")}

    @redco.hookimpl
    def on_resume(self, trainer, step, state):
        self.calls.append("on_resume")
        self.resumed_state = state


GLOBAL_BATCH = 8


def train(case, workdir, n_model_shards, n_local_devices=None, n_epochs=2, optimizer="adamw",
          sharding_rules="auto"):
    """Losses per step, final params and the trainer for ``case`` ("mlp" or "lm") at a fixed
    global batch of 8."""
    deployer = Deployer(jax_seed=0, n_model_shards=n_model_shards, workdir=workdir,
                        n_local_devices=n_local_devices, sharding_rules=sharding_rules,
                        verbose=False)
    if case == "mlp":
        apply_fn, params, collate, loss, examples = (mlp_apply, mlp_init(), mlp_collate,
                                                     mlp_loss, mlp_examples(64))
    else:
        (apply_fn, params), collate, loss, examples = lm_model(), lm_collate, lm_loss, lm_examples(32)
    recorder = Recorder()
    tx = optax.adamw(1e-2) if optimizer == "adamw" else optax.sgd(0.1, momentum=0.9)
    trainer = Trainer(deployer, collate, apply_fn, loss, params, tx,
                      callbacks=[recorder])
    trainer.fit(examples, GLOBAL_BATCH // deployer.dp_size, n_epochs=n_epochs)
    return recorder.losses, jax.device_get(trainer.params), trainer
