"""One of 2 processes of the background-checkpoint kill test (``test_background_checkpoints.py``):
``bg_ckpt_worker.py PROCESS_ID PORT WORKDIR [--kill POINT]``.

Trains helpers' tiny LLaMA-style LM on 8 simulated CPU devices, 4 a process (2 model shards),
2 epochs of 4 updates, a step checkpoint (orbax, written in the background) every 3 updates
and at each epoch's end, the last 2 kept; resumes from WORKDIR's checkpoints like any rerun of
the same command. Process 0 writes the final params to WORKDIR/final.npz. Every start appends
the step training starts from to WORKDIR/starts_<PROCESS_ID>.txt. Every ``on_checkpoint_saved``
checks, when it is called, that the checkpoint it announces is in place: ``ckpts/step_<step>``
(not a ``.tmp``), complete, its meta.json readable and of that step; it appends the step to
WORKDIR/announced_<PROCESS_ID>.txt, or exits 4 saying what it found. With ``--kill POINT`` this
process dies by SIGKILL at

* ``step:N`` - the end of update N, once no write is in flight;
* ``held:N`` - the end of update N+1, while its background write of ``step_N`` is held: the
  format has written this process's part (``step_N.tmp``; the barriers, meta.json and the
  rename still to come) and waits there, and the other process's writer has reached a barrier
  of that save (each writer says so in ``WORKDIR/barriers/<process>``). Training went on while
  the write was in flight, or update N+1 would not have ended: where it does not (a write that
  blocks training), the hold gives up after ``HOLD_S`` and the worker exits 3 saying so.
* ``term-held:N`` - the same hold, then before update N+1 a SIGTERM of this process (a
  preemption notice, which JAX's preemption service passes on to the other), and that update
  starts only once the processes agreed on the step to stop after (this process's own log says
  so): the step after the furthest either had reached, N+1 or N+2. The write stays
  held until the trainer waits for it (``trainer.checkpoints.join``), so a stop that saved
  without waiting would start its write with ``step_N`` unfinished, which is printed ("began
  with step_N still being written"); the stop saves and both processes exit 143.
"""
import os
import signal
import sys
import threading

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"  # XLA's INFO lines: the preemption sync point set
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "core"))

import argparse  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import numpy as np  # noqa: E402
import optax  # noqa: E402
from helpers import GLOBAL_BATCH, lm_collate, lm_examples, lm_loss, lm_model  # noqa: E402
from multihost_helpers import wait_until  # noqa: E402

import redco  # noqa: E402
from redco import Deployer, Trainer, checkpointing, ckpt_writes, plugins  # noqa: E402
from redco.protocols import CheckpointFormat  # noqa: E402
from redco.sharding import named_leaves  # noqa: E402

N_EXAMPLES, N_EPOCHS, SAVE_EVERY, KEEP = 32, 2, 3, 2  # 4 updates an epoch: saves at 3, 4, 6, 8
HOLD_S = 60  # the most a held write waits for the kill or the release that should come
# what JAX's preemption service logs once the processes agreed on the step to stop after
SYNC_POINT_SET = "Preemption sync counter is set"


def die(why: str) -> None:
    print(f"bg_ckpt_worker: SIGKILL {why}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


class HeldWrite(CheckpointFormat):
    """Registered under the name of the format it wraps (so it wins): that format, except that
    this process's background write of ``step_<step>`` is held once its part is written, until
    ``release`` is set (by ``term-held``) or ``HOLD_S`` have passed."""

    def __init__(self, name: str, step: int | None):
        self.name, self.step = name, step
        self.holding, self.release = threading.Event(), threading.Event()
        self.real = plugins.lookup("checkpoint_formats", name)

    @redco.hookimpl
    def register_checkpoint_formats(self, register):
        register(self.name, self)

    def save(self, path, tree):  # a write training waits for (a stop's)
        self.began(path)
        return self.real.save(path, tree)

    def began(self, path: str) -> None:
        """Say so where the write of ``path`` begins while the held one is unfinished."""
        if self.holding.is_set() and not self.release.is_set():
            print(f"bg_ckpt_worker: the write of {path} began with step_{self.step} still "
                  "being written", flush=True)

    def load(self, path, target):
        return self.real.load(path, target)

    def start_save(self, path, tree):
        finish = checkpointing.start_save(self.real, path, tree)
        if os.path.basename(os.path.dirname(path)) != f"step_{self.step}.tmp":
            self.began(path)
            return finish

        def held() -> None:
            finish()
            print(f"bg_ckpt_worker: holding the write of {path}", flush=True)
            self.holding.set()
            released = self.release.wait(HOLD_S)  # held: the kill comes first
            self.holding.clear()
            print(f"bg_ckpt_worker: released the write of {path}"
                  + ("" if released else f" after {HOLD_S} s"), flush=True)
        return held


class Killer:
    def __init__(self, workdir: str, point: str | None, n: int | None, fmt: HeldWrite):
        self.workdir, self.point, self.n, self.fmt = workdir, point, n, fmt

    @redco.hookimpl
    def on_fit_start(self, trainer, n_epochs, steps_per_epoch):
        with open(os.path.join(self.workdir, f"starts_{jax.process_index()}.txt"), "a") as f:
            f.write(f"{trainer.step}\n")

    @redco.hookimpl
    def on_step_end(self, trainer, step, metrics):
        if self.point == "step" and step == self.n:
            trainer.checkpoints.join()
            die(f"at the end of step {step}")
        if self.point == "held" and step == self.n + 1:
            if not self.fmt.holding.wait(timeout=HOLD_S):
                print(f"bg_ckpt_worker: step {step} ended with the write of step_{self.n} not "
                      "held in flight: training did not go on while it was written", flush=True)
                os._exit(3)
            barriers = os.path.join(self.workdir, "barriers", str(1 - jax.process_index()))
            wait_until(lambda: has_line(barriers, f"redco-ckpt/step_{self.n}/"),
                       f"the other process's writer reached a barrier of step_{self.n}", HOLD_S)
            die(f"at the end of step {step}, the write of step_{self.n} held in flight")

    @redco.hookimpl
    def on_checkpoint_saved(self, trainer, path, step):
        problem = not_in_place(path, step)
        if problem:
            print(f"bg_ckpt_worker: step_{step} announced before it was in place: {problem}",
                  flush=True)
            os._exit(4)
        with open(os.path.join(self.workdir, f"announced_{jax.process_index()}.txt"), "a") as f:
            f.write(f"{step}\n")

    @redco.hookimpl
    def on_train_batch_start(self, trainer, step):
        if self.point == "term-held" and step == self.n + 1:
            if not self.fmt.holding.wait(timeout=HOLD_S):
                sys.exit(f"bg_ckpt_worker: the write of step_{self.n} never reached its hold")
            checkpoints, join = trainer.checkpoints, trainer.checkpoints.join

            def released_then_joined() -> None:  # the trainer waits for the held write
                self.fmt.release.set()
                join()
            checkpoints.join = released_then_joined
            os.kill(os.getpid(), signal.SIGTERM)
            log = os.readlink("/proc/self/fd/2")
            wait_until(lambda: has_line(log, SYNC_POINT_SET),
                       f"JAX's preemption service logged '{SYNC_POINT_SET}'", HOLD_S)
            print(f"bg_ckpt_worker: SIGTERM before update {step}, the write of step_{self.n} "
                  "held in flight", flush=True)


def not_in_place(path: str, step: int) -> str | None:
    """What keeps ``path`` from being step ``step``'s complete checkpoint; None if nothing."""
    if os.path.basename(path) != f"step_{step}":
        return f"announced as {path}"
    if path not in checkpointing.step_ckpts(os.path.dirname(path)):
        return f"{path} is no complete checkpoint; its folder holds " \
               f"{sorted(os.listdir(os.path.dirname(path)))}"
    try:
        saved = checkpointing.read_meta(path)["step"]
    except (OSError, ValueError, KeyError) as e:
        return f"its meta.json is unreadable: {type(e).__name__}: {e}"
    return None if saved == step else f"its meta.json says step {saved}"


def has_line(path: str, text: str) -> bool:
    """Whether a line of ``path`` (another process's file, or this one's log) holds ``text``."""
    if not os.path.exists(path):
        return False
    with open(path) as f:
        return any(text in line for line in f)


def say_barriers(workdir: str) -> None:
    """Each barrier this process's writer reaches, appended to ``workdir/barriers/<process>``
    as it gets there (before waiting)."""
    barrier = ckpt_writes._barrier
    os.makedirs(os.path.join(workdir, "barriers"), exist_ok=True)

    def said(tag: str, name: str) -> None:
        with open(os.path.join(workdir, "barriers", str(jax.process_index())), "a") as f:
            f.write(tag + "\n")
        barrier(tag, name)
    ckpt_writes._barrier = said


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("process_id", type=int)
    parser.add_argument("port", type=int)
    parser.add_argument("workdir")
    parser.add_argument("--kill", default=None, help="step:N, held:N or term-held:N")
    args = parser.parse_args()
    point, n = args.kill.split(":") if args.kill else (None, None)
    assert point in (None, "step", "held", "term-held"), args.kill
    n = int(n) if n else None
    say_barriers(args.workdir)
    fmt = HeldWrite("orbax", n if point in ("held", "term-held") else None)
    plugins.pm.register(fmt)
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=args.workdir, verbose=False,
                        n_processes=2, host0_address="127.0.0.1", host0_port=args.port,
                        process_id=args.process_id)
    apply_fn, params = lm_model()
    trainer = Trainer(deployer, lm_collate, apply_fn, lm_loss, params, optax.adamw(1e-2),
                      callbacks=[Killer(args.workdir, point, n, fmt)])
    trainer.fit(lm_examples(N_EXAMPLES), GLOBAL_BATCH // deployer.dp_size, n_epochs=N_EPOCHS,
                save_every_n_steps=SAVE_EVERY, keep_last_ckpts=KEEP)
    params = jax.experimental.multihost_utils.process_allgather(trainer.params, tiled=True)
    if deployer.is_main_process:
        arrays = {path: np.asarray(x) for path, x in named_leaves(params)}
        np.savez(os.path.join(args.workdir, "final.tmp.npz"), **arrays)
        os.replace(os.path.join(args.workdir, "final.tmp.npz"),
                   os.path.join(args.workdir, "final.npz"))
    print(f"bg_ckpt_worker: finished at step {trainer.step}", flush=True)


if __name__ == "__main__":
    main()
