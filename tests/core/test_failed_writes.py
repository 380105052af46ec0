"""A step checkpoint whose background write fails (``redco/step_checkpoints.py``): the error is
raised on the training thread, saying so, and the checkpoints written before it are kept: on
disk, complete, and restored by a rerun to the params they were saved with, bit for bit."""
import errno
import os
import types

import jax
import numpy as np
import optax
import pytest
from helpers import mlp_apply, mlp_collate, mlp_examples, mlp_init, mlp_loss

import redco
from redco import Deployer, Trainer, checkpointing, plugins
from redco.protocols import CheckpointFormat

PER_DEVICE = 2  # 8 devices: 16 examples per update, rounds of 2 updates


class FailsOnItsSecondWrite(CheckpointFormat):
    """orbax, but the second write fails as a dying disk does (EIO), in the writer thread."""

    def __init__(self):
        self.real, self.writes = plugins.lookup("checkpoint_formats", "orbax"), 0

    def save(self, path, tree):
        self.writes += 1
        if self.writes == 2:
            raise OSError(errno.EIO, os.strerror(errno.EIO), path)
        self.real.save(path, tree)

    def load(self, path, target):
        return self.real.load(path, target)


@pytest.fixture
def failing_format():
    fmt = FailsOnItsSecondWrite()
    plugin = types.SimpleNamespace(register_checkpoint_formats=redco.hookimpl(
        lambda register: register("fails-on-its-second-write", fmt)))
    plugins.pm.register(plugin, name="fails-on-its-second-write")
    yield "fails-on-its-second-write"
    plugins.pm.unregister(name="fails-on-its-second-write")


def rounds(workdir, fmt: str, n_rounds: int, after_round=lambda trainer, round_: None):
    """A loop of ``n_rounds`` rounds, a step checkpoint every 2 steps (each round), the newest
    one kept; ``after_round(trainer, round_)`` once each round's checkpoint is started."""
    deployer = Deployer(jax_seed=0, workdir=str(workdir), verbose=False, checkpoint_format=fmt)
    trainer = Trainer(deployer, mlp_collate, mlp_apply, mlp_loss, mlp_init(n_layers=3),
                      optax.adam(1e-2))
    trainer.prepare(mlp_examples(16), PER_DEVICE)
    with trainer.run(save_every_n_steps=2, keep_last_ckpts=1) as run:
        for round_ in range(trainer.step // 2, n_rounds):
            trainer.train_epoch(mlp_examples(32, seed=round_), PER_DEVICE, epoch=round_)
            run.step_done()
            after_round(trainer, round_)
    return trainer, run


def test_a_failed_background_write_raises_on_the_training_thread_and_keeps_the_earlier(
        tmp_path, failing_format):
    saved, reached = {}, []

    def after_round(trainer, round_):
        reached.append(trainer.step)
        if trainer.step == 2:  # step_2's write started: the params it holds, as they are now
            saved.update(jax.device_get(trainer.params))
    with pytest.raises(RuntimeError, match=r"Writing a step checkpoint in the background "
                                           r"failed: OSError: .*Input/output error.*The "
                                           r"checkpoints before it are kept") as failed:
        rounds(tmp_path, failing_format, n_rounds=6, after_round=after_round)
    assert isinstance(failed.value.__cause__, OSError) and \
        failed.value.__cause__.errno == errno.EIO
    assert reached[0] == 2 and reached[-1] < 12  # raised during the run (not at its end)
    ckpts = tmp_path / "ckpts"
    assert sorted(os.listdir(ckpts)) == ["step_2"]  # step_4's partial write removed
    tree, meta = checkpointing.load(str(ckpts / "step_2"), {"params": saved})
    assert meta["step"] == 2
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(tree["params"]), saved)
    trainer, run = rounds(tmp_path, "orbax", n_rounds=1)  # a rerun: resumes, trains nothing
    assert os.path.basename(run.resumed_from) == "step_2" and trainer.step == 2
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(trainer.params), saved)
