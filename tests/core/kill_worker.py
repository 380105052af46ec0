"""One training command for the kill tests (tests/core/test_kill_resume.py, orbax, and
tests/formats/test_format_kill_resume.py, every format):
``kill_worker.py WORKDIR [--format NAME] [--kill POINT]``.

Trains helpers' tiny LLaMA-style LM (2 model shards on 8 simulated CPU devices, 3 epochs of 4
updates, a step checkpoint every 3 updates and at each epoch's end, the last 2 kept), resuming
from WORKDIR's checkpoints like any rerun of the same command, and writes the final params to
WORKDIR/final.npz. With ``--kill POINT`` the process SIGKILLs itself at

* ``step:N``  - in ``on_step_end`` for update N (before any checkpoint of N is written);
* ``write:N`` - in the middle of writing checkpoint ``step_N``: the real writer of the format
  (``--format``, default ``orbax``) has run, then the biggest file under ``step_N.tmp/state`` is
  cut to half its size (no meta.json yet);
* ``saved:N`` - in ``on_checkpoint_saved`` for ``step_N`` (renamed into place and pruned).

Every start appends the step training starts from (after any resume) to WORKDIR/starts.txt.
"""
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/core, for helpers

import numpy as np  # noqa: E402
import optax  # noqa: E402
from helpers import GLOBAL_BATCH, lm_collate, lm_examples, lm_loss, lm_model  # noqa: E402

import redco  # noqa: E402
from redco import Deployer, Trainer, plugins  # noqa: E402
from redco.protocols import CheckpointFormat  # noqa: E402
from redco.sharding import named_leaves  # noqa: E402

N_EXAMPLES, N_EPOCHS, SAVE_EVERY, KEEP = 32, 3, 3, 2  # 4 updates an epoch, 12 in all
STEPS_PER_EPOCH = N_EXAMPLES // GLOBAL_BATCH


def die(why: str) -> None:
    print(f"kill_worker: SIGKILL {why}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


class KillingFormat(CheckpointFormat):
    """Registered under the name of the format it wraps, after that one (so it wins): the real
    format, except that the save of ``step_<kill_step>`` is left half-written and the process
    dies."""

    def __init__(self, name, kill_step):
        self.name, self.kill_step = name, kill_step
        self.real = plugins.lookup("checkpoint_formats", name)

    @redco.hookimpl
    def register_checkpoint_formats(self, register):
        register(self.name, self)

    def save(self, path, tree):
        self.real.save(path, tree)
        m = re.search(r"step_(\d+)\.tmp$", os.path.dirname(path))
        if m and int(m.group(1)) == self.kill_step:
            files = [os.path.join(d, f) for d, _, names in os.walk(path) for f in names]
            biggest = max(files, key=os.path.getsize)
            os.truncate(biggest, os.path.getsize(biggest) // 2)
            die(f"while writing {os.path.dirname(path)} ({biggest} cut to half)")

    def load(self, path, target):
        return self.real.load(path, target)


class Killer:
    """Per-run callbacks: record where training starts; die at ``step:N`` / ``saved:N``."""

    def __init__(self, workdir, point, n):
        self.workdir, self.point, self.n = workdir, point, n

    @redco.hookimpl
    def on_fit_start(self, trainer, n_epochs, steps_per_epoch):
        with open(os.path.join(self.workdir, "starts.txt"), "a") as f:
            f.write(f"{trainer.step}\n")

    @redco.hookimpl
    def on_step_end(self, trainer, step, metrics):
        if self.point == "step" and step == self.n:
            die(f"at the end of step {step}")

    @redco.hookimpl
    def on_checkpoint_saved(self, trainer, path, step):
        if self.point == "saved" and step == self.n:
            die(f"just after saving {path}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir")
    parser.add_argument("--format", default="orbax", help="the checkpoint format to write")
    parser.add_argument("--kill", default=None, help="step:N, write:N or saved:N")
    args = parser.parse_args()
    point, n = (None, None)
    if args.kill:
        point, n = args.kill.split(":")
        n = int(n)
        assert point in ("step", "write", "saved"), args.kill
    os.makedirs(args.workdir, exist_ok=True)

    plugins.pm.register(KillingFormat(args.format, n if point == "write" else None))
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=args.workdir, verbose=False,
                        checkpoint_format=args.format)
    apply_fn, params = lm_model()
    trainer = Trainer(deployer, lm_collate, apply_fn, lm_loss, params, optax.adamw(1e-2),
                      callbacks=[Killer(args.workdir, point, n)])
    trainer.fit(lm_examples(N_EXAMPLES), GLOBAL_BATCH // deployer.dp_size, n_epochs=N_EPOCHS,
                save_every_n_steps=SAVE_EVERY, keep_last_ckpts=KEEP)

    arrays = {path: np.asarray(x) for path, x in named_leaves(jax.device_get(trainer.params))}
    arrays["__step__"] = np.asarray(trainer.step)
    tmp = os.path.join(args.workdir, "final.tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, os.path.join(args.workdir, "final.npz"))
    print(f"kill_worker: finished at step {trainer.step}", flush=True)


if __name__ == "__main__":
    main()
