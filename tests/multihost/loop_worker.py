"""One of 2 processes running a loop of rounds of its own (``trainer.run``) on 127.0.0.1, for
``test_loop_processes.py``: ``loop_worker.py PROCESS_ID PORT WORKDIR [--host_work S0,S1]
[--save_every_minutes M] [--sigterm_at STEP]``.

Trains helpers' MLP on 8 simulated CPU devices, 4 a process, in 6 rounds of 2 updates (a round:
``train_epoch`` over that round's 32 examples); resumes from WORKDIR's checkpoints like any rerun.
``--host_work``: each round, process ``i`` works on the host for ``S_i`` seconds before it trains
(a rollout, data preparation: the processes' clocks drift apart). ``--sigterm_at N``: process 1
gets SIGTERM at the end of update N (inside a round), and goes on once JAX's preemption service
has agreed with process 0 on the boundary to stop at (it logs so; the notice takes up to a
second to arrive, in which a short run could end). Each process appends the step of every
checkpoint announced to it (``on_checkpoint_saved``) to ``WORKDIR/saved_<i>.txt``; process 0
writes the final params to ``WORKDIR/final.npz``.
"""
import argparse
import os
import signal
import sys
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"  # XLA's INFO lines: the preemption sync point set
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "core"))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from helpers import mlp_apply, mlp_collate, mlp_examples, mlp_init, mlp_loss  # noqa: E402
from multihost_helpers import wait_until  # noqa: E402

import redco  # noqa: E402
from redco import Deployer, Trainer  # noqa: E402
from redco.sharding import named_leaves  # noqa: E402

N_ROUNDS, PER_DEVICE = 6, 2  # 8 devices: 16 examples an update, 2 updates a round


class Rounds:
    def __init__(self):
        self.done = 0

    def state_dict(self) -> dict:
        return {"done": self.done}

    def load_state_dict(self, state: dict) -> None:
        self.done = state["done"]


class Watch:
    def __init__(self, workdir: str, sigterm_at: int | None):
        self.saved = os.path.join(workdir, f"saved_{jax.process_index()}.txt")
        self.sigterm_at = sigterm_at

    @redco.hookimpl
    def on_step_end(self, trainer, step, metrics):
        if step == self.sigterm_at and jax.process_index() == 1:
            os.kill(os.getpid(), signal.SIGTERM)
            log = os.readlink("/proc/self/fd/2")
            wait_until(lambda: "Preemption sync counter is set" in open(log).read(),
                       "JAX's preemption service set the boundary to stop at", 60)

    @redco.hookimpl
    def on_checkpoint_saved(self, trainer, path, step):
        with open(self.saved, "a") as f:
            f.write(f"{step}\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("process_id", type=int)
    parser.add_argument("port", type=int)
    parser.add_argument("workdir")
    parser.add_argument("--host_work", default="0,0")
    parser.add_argument("--save_every_minutes", type=float)
    parser.add_argument("--sigterm_at", type=int)
    args = parser.parse_args()
    deployer = Deployer(jax_seed=0, workdir=args.workdir, verbose=False, n_processes=2,
                        host0_address="127.0.0.1", host0_port=args.port,
                        process_id=args.process_id, hang_timeout_s=60)
    trainer = Trainer(deployer, mlp_collate, mlp_apply, mlp_loss, mlp_init(n_layers=3),
                      optax.adam(1e-2), callbacks=[Watch(args.workdir, args.sigterm_at)])
    trainer.prepare(mlp_examples(16), PER_DEVICE)
    host_work = float(args.host_work.split(",")[args.process_id])
    loop = Rounds()
    with trainer.run(loop=loop, save_every_minutes=args.save_every_minutes) as run:
        while loop.done < N_ROUNDS:
            busy_until = time.monotonic() + host_work
            while time.monotonic() < busy_until:  # the host's own work for this round
                pass
            trainer.train_epoch(mlp_examples(32, seed=loop.done), PER_DEVICE, epoch=loop.done)
            loop.done += 1
            run.step_done()
    params = jax.experimental.multihost_utils.process_allgather(trainer.params, tiled=True)
    if jax.process_index() == 0:
        np.savez(os.path.join(args.workdir, "final.npz"),
                 **{path: np.asarray(x) for path, x in named_leaves(params)})


if __name__ == "__main__":
    main()
