"""The installed plugin is listed by ``redco list plugins`` and its rule set shards a model."""
import json
import os
import subprocess
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from redco import Deployer, Trainer  # noqa: E402


def test_redco_plugins_lists_it():
    out = subprocess.run([sys.executable, "-m", "redco.cli", "plugins", "--json"],
                         capture_output=True, text=True, check=True).stdout
    rows = {row["name"]: row for row in json.loads(out)}
    assert rows["{{project_name}}"]["hooks"] == ["register_sharding_rules"]


def test_its_rule_set_shards_and_trains(tmp_path):
    params = {"wide": {"kernel": jnp.ones((4, 16)) / 8}, "tall": {"kernel": jnp.ones((16, 2)) / 8}}
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=str(tmp_path), verbose=False,
                        sharding_rules="{{project_name}}")
    specs = {path: spec for path, spec in deployer.get_sharding_rules(params)}
    assert specs == {"^wide/kernel$": P(None, "mp"), "^tall/kernel$": P("mp", None)}

    def loss_fn(state, params, batch):
        return jnp.mean((state.apply_fn(params, batch["x"]) - batch["y"]) ** 2)

    def apply_fn(params, x):
        return jnp.tanh(x @ params["wide"]["kernel"]) @ params["tall"]["kernel"]

    def collate_fn(examples):
        return {k: np.stack([e[k] for e in examples]).astype(np.float32) for k in ("x", "y")}

    trainer = Trainer(deployer, collate_fn, apply_fn, loss_fn, params, optax.adam(1e-2))
    rng = np.random.default_rng(0)
    examples = [{"x": rng.normal(size=4), "y": rng.normal(size=2)} for _ in range(64)]
    trainer.fit(examples, 2, n_epochs=1)
    assert trainer.state.params["wide"]["kernel"].sharding.spec == P(None, "mp")
    assert jax.numpy.isfinite(trainer.eval_loss(examples, 2))
