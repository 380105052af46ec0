"""One training command for tests/core/test_watchdog.py: ``hang_worker.py WORKDIR MODE``, with
the hang timeout from ``REDCO_HANG_TIMEOUT`` (as a user sets it); ``hang_worker.py WORKDIR MODE
SECONDS``: from ``Trainer(hang_timeout_s=SECONDS)``, on a ``Deployer(hang_timeout_s=0)`` (off).
Trains helpers' MLP, one epoch of 8 updates (global batch 16 on 8 simulated CPU devices),
evaluating at the epoch's end.

* ``hang:N`` - the collate_fn never returns from its call for update N + 1 (a deadlocked data
  loader); just before, it writes the wall time to ``WORKDIR/hung_at``.
* ``slow:S`` - everything that is not a step takes S seconds longer: tracing the loss (so the
  first step's compile), each step checkpoint (every 3 updates and at the end), the evaluation,
  and a callback's own work after update 5 (under ``trainer.hang_watch_paused()``). The run must
  end normally.
* ``stuck-save:N`` - the write of step checkpoint ``step_N`` never ends (a filesystem that stopped
  answering, a save another process never joins); just before, it writes the wall time to
  ``WORKDIR/hung_at``.
"""
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import threading  # noqa: E402
import time  # noqa: E402

import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/core, for helpers
from helpers import mlp_apply, mlp_collate, mlp_examples, mlp_init, mlp_loss  # noqa: E402

import redco  # noqa: E402
from redco import Deployer, Trainer, plugins  # noqa: E402
from redco.protocols import CheckpointFormat  # noqa: E402

workdir, mode = sys.argv[1], sys.argv[2]
on_trainer = {} if len(sys.argv) < 4 else {"hang_timeout_s": float(sys.argv[3])}
kind, _, value = mode.partition(":")
collated = {"n": None}  # collate_fn calls once training started


class Slow:
    @redco.hookimpl
    def on_fit_start(self, trainer, n_epochs, steps_per_epoch):
        collated["n"] = 0

    @redco.hookimpl
    def on_step_end(self, trainer, step, metrics):
        if kind == "slow" and step == 5:
            with trainer.hang_watch_paused():
                time.sleep(float(value))

    @redco.hookimpl
    def on_checkpoint_saved(self, trainer, path, step):
        if kind == "slow":
            time.sleep(float(value))

    @redco.hookimpl
    def on_eval_end(self, trainer, epoch, metrics):
        if kind == "slow":
            time.sleep(float(value))


def collate(examples):
    if collated["n"] is not None:
        collated["n"] += 1
        if kind == "hang" and collated["n"] == int(value) + 1:
            with open(os.path.join(workdir, "hung_at"), "w") as f:
                f.write(repr(time.time()))
            threading.Event().wait()  # forever
    return mlp_collate(examples)


def loss(rng, state, params, batch, is_training):
    if kind == "slow":
        time.sleep(float(value))  # runs while tracing: the compile of a big model
    return mlp_loss(rng, state, params, batch, is_training)


class StuckSave(CheckpointFormat):
    """Orbax, except that the save of ``step_<value>`` never returns (registered as "orbax")."""

    def __init__(self):
        self.real = plugins.lookup("checkpoint_formats", "orbax")

    @redco.hookimpl
    def register_checkpoint_formats(self, register):
        register("orbax", self)

    def save(self, path, tree):
        if f"step_{value}.tmp" in path:
            with open(os.path.join(workdir, "hung_at"), "w") as f:
                f.write(repr(time.time()))
            threading.Event().wait()  # forever
        return self.real.save(path, tree)

    def load(self, path, target):
        return self.real.load(path, target)


if kind == "stuck-save":
    plugins.pm.register(StuckSave())
deployer = Deployer(jax_seed=0, workdir=workdir, verbose=False,
                    **({"hang_timeout_s": 0} if on_trainer else {}))
trainer = Trainer(deployer, collate, mlp_apply, loss, mlp_init(), optax.adam(1e-3),
                  callbacks=[Slow()], **on_trainer)
examples = mlp_examples(128)
trainer.fit(examples, per_device_batch_size=2, n_epochs=1, eval_examples=examples[:16],
            save_every_n_steps=3)
print("fit ended", flush=True)
