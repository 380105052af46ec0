"""8 simulated CPU devices (set before jax is imported), exact matmuls, offline hubs; a tiny LM
trained with ``Deployer(n_model_shards="auto")`` (``fit_auto``)."""
import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["HF_HUB_OFFLINE"] = "1"

import jax  # noqa: E402
import pytest  # noqa: E402
from planner_helpers import lm_examples, lm_model  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# The backends start here with those 8 devices, whatever test runs first: an in-process
# ``redco plan --devices 1`` run before any jax operation would leave the whole suite on 1.
assert jax.device_count() == 8, jax.devices()


@pytest.fixture(autouse=True)
def environment_restored():
    """``redco plan`` run in-process (``main([...])``) sets XLA_FLAGS for its ``--devices``; later
    tests' subprocesses must see the suite's 8 devices again."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def workdir(tmp_path):
    return str(tmp_path / "workdir")


def train_auto(workdir, memory, n_examples=32, remat=None):
    """``Deployer(n_model_shards="auto", device_memory=memory)`` and one epoch of Trainer.fit
    (``Trainer(remat=remat)``: None lets the planner choose); returns the deployer and the
    trainer."""
    import optax

    from redco import Deployer, Trainer
    from redco_zoo_lm import collate_fn, loss_fn
    apply_fn, params = lm_model()
    deployer = Deployer(jax_seed=0, n_model_shards="auto", device_memory=memory, workdir=workdir,
                        verbose=False)
    trainer = Trainer(deployer, collate_fn, apply_fn, loss_fn, params, optax.adamw(1e-2),
                      remat=remat)
    trainer.fit(lm_examples(n_examples), per_device_batch_size=1, n_epochs=1)
    return deployer, trainer


@pytest.fixture
def fit_auto():
    return train_auto
