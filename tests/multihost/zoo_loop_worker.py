"""One of 2 processes running a zoo loop on 127.0.0.1, for ``test_zoo_loops_processes.py``:
``zoo_loop_worker.py LOOP[,LOOP...] PROCESS_ID PORT WORKDIR [--sigterm N] [--sigkill N] [--held N]
[--rollout_devices N|auto]``
(several loops: one after the other in the same processes, each in ``WORKDIR/LOOP``).

LOOP is ``fedavg``, ``maml``, ``ppo``, ``grpo`` or ``async_grpo``, each the zoo's own code
(``fedavg()``, ``train()``, ``redco zoo run grpo`` on the task ``test_grpo_processes.write_task``
wrote next to WORKDIR) on a tiny task, on 8 simulated CPU devices, 4 a process, joined through
the ``ip`` launcher's variables (as ``redco launch --launcher ip`` sets them); it resumes from
WORKDIR's checkpoints like any rerun of the same command. Step checkpoints: FedAvg every round
(5 rounds of 2 of 4 clients), MAML every 5 of its 12 meta-updates (each a boundary of ``fit``),
PPO every iteration (4 of 16 updates, one compiled call each); and at the end.

* ``--sigterm N``: process 1 sends itself SIGTERM inside a unit of its loop, at the N-th such
  point of this run: FedAvg inside a client's local epoch (the end of the run's N-th update:
  the updates of a round are no boundary), MAML inside the inner adaptation of update N (a
  host callback in the compiled step, while it runs), PPO in iteration N's rollout, async
  GRPO in the N-th call of its reward function. It goes on
  once JAX's preemption service has agreed with process 0 on the boundary to stop at (its log
  says so: the notice takes up to a second, in which a short run could end).
* ``--sigkill N``: process 0 (the coordinator) dies by SIGKILL at the N-th point of this run
  (the same kinds of points; the test picks the first after a boundary that saved, whose write
  then runs in the background; async GRPO waits there for that write to be in place).
* ``--rollout_devices`` (async GRPO): its ``--rollout_devices`` (default 2); ``--device_memory``
  its ``--device_memory`` (``auto``'s planner: 1GB unless given).
* ``--held N`` (GRPO): process 0 holds its background write of ``step_N`` and dies by SIGKILL
  at the end of update N + 1 (``bg_ckpt_worker.py``'s ``held:N``).

Each process appends the step of every checkpoint announced to it (``on_checkpoint_saved``) to
``WORKDIR/saved_<i>.txt`` (FedAvg: of every round's end to ``WORKDIR/rounds_<i>.txt``) and, at
its end, what the loop returned to ``WORKDIR/result_<i>.json`` (FedAvg: the sums of the server's
params; MAML: the held-out MSEs; PPO: the last episodes' returns).
"""
import argparse
import json
import os
import pathlib
import signal
import threading

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["REDCO_HANG_TIMEOUT"] = "60"  # a process left waiting for a dead one fails soon
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"  # XLA's INFO lines: the preemption sync point set

import jax  # noqa: E402
import numpy as np  # noqa: E402
from multihost_helpers import wait_until  # noqa: E402

import redco  # noqa: E402

SYNC_POINT_SET = "Preemption sync counter is set"  # JAX's log line once the processes agreed


class Points:
    """Counts this run's points of the loop; at ``sigterm``'s (process 1) signals SIGTERM, at
    ``sigkill``'s (process 0) dies. ``reached()`` is called at each point, maybe off the main
    thread (a host callback); ``settle()`` on the main thread waits for the agreed stop."""

    def __init__(self, workdir: str, process: int, sigterm: int | None, sigkill: int | None,
                 held: int | None):
        self.saved = os.path.join(workdir, f"saved_{process}.txt")
        self.process, self.held, self.plugins = process, held, [self]
        self.n, self.signalled, self.lock = 0, False, threading.RLock()
        self.sigterm = sigterm if process == 1 else None
        self.sigkill = sigkill if process == 0 else None

    def reached(self) -> None:
        with self.lock:
            self.n += 1
            if self.n == self.sigkill:
                print(f"zoo_loop_worker: SIGKILL at point {self.n}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if self.n == self.sigterm:
                print(f"zoo_loop_worker: SIGTERM at point {self.n}", flush=True)
                self.signalled = True
                os.kill(os.getpid(), signal.SIGTERM)

    def plug(self, *plugins) -> None:
        """Register ``plugins`` (process-wide) for this loop's run."""
        for plugin in plugins:
            redco.plugins.pm.register(plugin)
            self.plugins.append(plugin)

    def settle(self) -> None:
        if self.signalled:
            self.signalled = False
            log = os.readlink("/proc/self/fd/2")
            wait_until(lambda: SYNC_POINT_SET in open(log).read(),
                       "JAX's preemption service set the boundary to stop at", 60)

    @redco.hookimpl
    def on_checkpoint_saved(self, trainer, path, step):
        with open(self.saved, "a") as f:
            f.write(f"{step}\n")


def fedavg(workdir: str, points: Points):
    """4 clients of 2 labels each (scikit-learn's digits' shapes, made here), 2 a round, 5 rounds
    of one local epoch."""
    import optax

    from redco_zoo_fedavg import pipeline

    class Inside:  # the end of each update: inside a client's local epoch
        @redco.hookimpl
        def on_step_end(self, trainer, step, metrics):
            points.reached()
            points.settle()
    points.plug(Inside())
    rng = np.random.default_rng(0)
    digits = [{"x": x, "y": int(y)} for x, y in zip(rng.integers(0, 17, (400, 64)),
                                                     rng.integers(0, 10, 400))]
    clients = pipeline.split_clients(digits, 4, iid=False)
    deployer = redco.Deployer(jax_seed=0, workdir=workdir, verbose=False, hang_timeout_s=60)
    trainer = redco.Trainer(deployer, pipeline.collate_fn, pipeline.apply_fn, pipeline.loss_fn,
                            jax.device_get(pipeline.init_params(0)), optax.sgd(0.1))
    rounds = os.path.join(workdir, f"rounds_{jax.process_index()}.txt")

    def on_round(r: int, server) -> None:  # the step each round ended at
        with open(rounds, "a") as f:
            f.write(f"{trainer.step}\n")
    server = pipeline.fedavg(trainer, clients, n_rounds=5, clients_per_round=2, local_epochs=1,
                             per_device_batch_size=2, save_every_n_steps=1, on_round=on_round)
    return [float(x.sum()) for x in jax.tree.leaves(server)]


def maml(workdir: str, points: Points):
    """12 meta-updates of 16 tasks (2 a device), second order."""
    from redco_zoo_maml import pipeline
    adapt, loss_fn, step, seen = pipeline.adapt, pipeline.loss_fn, [], set()

    def loss_at_step(rng, state, params, batch, is_training, **kwargs):
        step[:] = [state.step]  # (traced) for the inner adaptation's callback
        try:
            return loss_fn(rng, state, params, batch, is_training, **kwargs)
        finally:
            step.clear()  # (pred_fn adapts too, outside any update)

    def inner(s) -> None:  # once per device (and task): a point per update
        with points.lock:
            if int(s) not in seen:
                seen.add(int(s))
                points.reached()

    def adapt_with_callback(*args, **kwargs):  # called while the compiled step runs
        if step:
            jax.debug.callback(inner, step[0], partitioned=True)  # on every device
        return adapt(*args, **kwargs)

    class After:
        @redco.hookimpl
        def on_step_end(self, trainer, step, metrics):
            points.settle()
    pipeline.adapt, pipeline.loss_fn = adapt_with_callback, loss_at_step
    points.plug(After())
    return pipeline.train(n_meta_iterations=12, meta_batch_size=16, n_eval_tasks=16,
                          workdir=workdir, save_every_n_steps=5)


def ppo(workdir: str, points: Points):
    """CartPole, 4 envs x 64 steps an iteration, 4 epochs of 4 minibatches: 16 updates each."""
    from redco_zoo_ppo import pipeline
    rollout = pipeline.Collector.rollout

    def rollout_with_points(self, *args, **kwargs):
        points.reached()
        points.settle()
        return rollout(self, *args, **kwargs)
    pipeline.Collector.rollout = rollout_with_points
    _, returns = pipeline.train("CartPole-v1", total_steps=4 * 256, n_envs=4, n_steps=64,
                                workdir=workdir, verbose=False, save_every_n_steps=16)
    return returns


def grpo(workdir: str, points: Points):
    """``redco zoo run grpo`` of ``test_grpo_processes.py`` (3 rounds of 4 updates, 2 model
    shards), a step checkpoint every round, written in the background by ``bg_ckpt_worker.py``'s
    format, which holds process 0's write of ``step_<points.held>`` (its part written) until
    process 0 is SIGKILLed at the end of the next update (the next round's first), once process
    1's writer waits at a barrier of that save; ``bg_ckpt_worker.py``'s checks come along (no
    checkpoint announced before it is in place)."""
    from bg_ckpt_worker import HeldWrite, Killer, say_barriers
    from test_grpo_processes import grpo as grpo_command

    from redco.cli import main as redco_main
    held = points.held if points.process == 0 else None
    fmt = HeldWrite("orbax", held)
    say_barriers(workdir)
    points.plug(fmt, Killer(workdir, "held" if held else None, held, fmt))
    redco_main(grpo_command(pathlib.Path(workdir).parent, workdir, 8)[3:])


def async_grpo(workdir: str, points: Points):
    """``redco zoo run grpo`` of ``test_grpo_async_processes.py`` (asynchronous, 3 rounds, a
    step checkpoint every round, ``--rollout_devices points.rollout``); a point at each call of
    the reward function (a run from scratch: 1 the greedy evaluation before round 1, 2 round
    1's rollouts, 3 round 2's, ...; a resumed run: 1 the next round's rollouts, ...).
    ``--sigkill``'s point waits for this run's first step checkpoint to be in place (written
    in the background: process 0 renames it once both wrote their parts), then process 0 dies."""
    from test_grpo_async_processes import grpo_async

    from redco import checkpointing
    from redco.cli import main as redco_main
    from redco_zoo_grpo import rewards
    regex_match = rewards.BUILT_IN["regex_match"]
    ckpts = os.path.join(workdir, "ckpts")
    before = checkpointing.step_ckpts(ckpts)

    def counted(*args, **kwargs):
        if points.sigkill == points.n + 1:
            wait_until(lambda: checkpointing.step_ckpts(ckpts) != before,
                       "this run's first step checkpoint is in place", 120)
        points.reached()
        points.settle()
        return regex_match(*args, **kwargs)
    rewards.BUILT_IN["regex_match"] = counted
    memory = ["--device_memory", points.device_memory] if points.device_memory else []
    redco_main(grpo_async(pathlib.Path(workdir).parent, workdir, 8, points.rollout)[3:] + memory)


LOOPS = {"fedavg": fedavg, "grpo": grpo, "async_grpo": async_grpo, "maml": maml, "ppo": ppo}


def run(loop: str, workdir: str, args: argparse.Namespace) -> None:
    """``loop`` in ``workdir``, its result written there; its plugins gone after."""
    os.makedirs(workdir, exist_ok=True)
    # GRPO as ``redco zoo run grpo`` runs, at JAX's default precision like its uninterrupted run
    # (under ``redco launch``): the same programs, so the rerun loads them from the compile cache
    jax.config.update("jax_default_matmul_precision",
                      None if loop.endswith("grpo") else "highest")
    points = Points(workdir, args.process_id, args.sigterm, args.sigkill, args.held)
    points.rollout, points.device_memory = args.rollout_devices, args.device_memory
    redco.plugins.pm.register(points)
    try:
        result = LOOPS[loop](workdir, points)
    finally:
        for plugin in points.plugins:
            redco.plugins.pm.unregister(plugin)
    with open(os.path.join(workdir, f"result_{jax.process_index()}.json"), "w") as f:
        json.dump(result, f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("loops", help="LOOP, or LOOP,LOOP,... run one after the other, each in "
                        "WORKDIR/LOOP (one uninterrupted reference run of several)")
    parser.add_argument("process_id", type=int)
    parser.add_argument("port", type=int)
    parser.add_argument("workdir")
    parser.add_argument("--sigterm", type=int)
    parser.add_argument("--sigkill", type=int)
    parser.add_argument("--held", type=int)
    parser.add_argument("--rollout_devices", default="2", help="async_grpo's")
    parser.add_argument("--device_memory", help="async_grpo's (the planner's memory a device)")
    args = parser.parse_args()
    os.environ.update(REDCO_N_PROCESSES="2", REDCO_HOST0_ADDRESS="127.0.0.1",
                      REDCO_HOST0_PORT=str(args.port), REDCO_PROCESS_ID=str(args.process_id))
    loops = args.loops.split(",")
    assert set(loops) <= set(LOOPS), f"loops are {sorted(LOOPS)}"
    for loop in loops:
        run(loop, args.workdir if len(loops) == 1 else os.path.join(args.workdir, loop), args)


if __name__ == "__main__":
    main()
