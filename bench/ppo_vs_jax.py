"""Environment steps per second of Redco's PPO (``redco_zoo_ppo``) against a minimal hand-written
JAX PPO, in one run, side by side.

Both sides run the same algorithm with the same settings for the same number of env steps: the
network, loss, gymnasium vector envs, rollout collector (``Collector``: a jitted policy per env
step, GAE on the host) and optax optimizer are imported from ``redco_zoo_ppo`` (pure JAX/numpy,
so the math is identical), and the minibatches come in the Trainer's order. Only the updates
differ: Redco goes through ``Trainer.train_scanned`` (the rollout collated and placed on the
mesh once, every epoch and minibatch of an iteration in one compiled ``lax.scan`` of Trainer's
step, then per-step metrics, logging and hooks); the hand-written side runs every epoch and
minibatch of an iteration as one ``jax.jit`` of ``lax.scan``s on one device.
Compilation is included on both sides (one fresh run each). The mean return of the last 20
episodes is printed too, as a check that both learn.

Run:  python bench/ppo_vs_jax.py [--total_steps 300000 --n_envs 8 --devices 1 --seed 0] 2>/dev/null
``--devices 8`` simulates 8 CPU devices: Redco then runs data-parallel over all 8, and so does a
second hand-written side (the first stays on one device); stderr holds
the Trainer's progress bars.
"""
from __future__ import annotations

import argparse
import functools
import os
import tempfile
import time
from types import SimpleNamespace

PARSER = argparse.ArgumentParser(description=__doc__.split("\n")[0])
PARSER.add_argument("--env_id", default="CartPole-v1")
PARSER.add_argument("--total_steps", type=int, default=300_000)
PARSER.add_argument("--n_envs", type=int, default=16)
PARSER.add_argument("--seed", type=int, default=0)
PARSER.add_argument("--devices", type=int, default=1, help="simulated CPU devices")
if __name__ == "__main__":  # before jax starts
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={PARSER.parse_args().devices}"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import redco_zoo_ppo.pipeline as ppo  # noqa: E402


def jax_ppo(env_id="CartPole-v1", total_steps=300_000, n_envs=16, n_steps=64, seed=0, lr=1e-3,
            update_epochs=4, n_minibatches=4, gamma=0.98, lam=0.8, data_parallel=False):
    """The same PPO with a hand-written update: one jit per iteration, on one device, or with
    ``data_parallel`` on all of them (params and rollout replicated, each minibatch split over
    the devices, as Redco lays it out). Returns the last 100 episode returns."""
    collector = ppo.Collector(env_id, n_envs, jax.jit(ppo.pred_fn), seed)
    n_iters, size = total_steps // (n_envs * n_steps), n_envs * n_steps
    schedule = optax.linear_schedule(lr, 0.0, n_iters * update_epochs * n_minibatches)
    tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(schedule, eps=1e-5))
    space = collector.envs.single_observation_space.shape[0], collector.envs.single_action_space.n
    params = ppo.init_params(jax.random.PRNGKey(seed), *space)
    opt_state, state = tx.init(params), SimpleNamespace(apply_fn=ppo.apply_fn)

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("dp",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("dp"))

    @functools.partial(jax.jit, in_shardings=replicated if data_parallel else None)
    def update(params, opt_state, data, orders):
        def minibatch(carry, idx):
            params, opt_state = carry
            batch = jax.tree.map(lambda x: x[idx], data)
            if data_parallel:
                batch = jax.lax.with_sharding_constraint(batch, split)
            grads = jax.grad(lambda p: ppo.loss_fn(None, state, p, batch, True))(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), None

        def epoch(carry, order):
            return jax.lax.scan(minibatch, carry, order.reshape(n_minibatches, -1))[0], None
        return jax.lax.scan(epoch, (params, opt_state), orders)[0]

    for it in range(n_iters):
        acting = jax.device_put(jax.device_get(params), jax.devices()[0])  # as Redco acts
        transitions = collector.rollout(acting, jax.random.PRNGKey(seed + 1 + it), n_steps, gamma,
                                        lam)
        data = ppo.collate_fn(transitions)
        orders = np.stack([np.random.default_rng([seed, it * update_epochs + e]).permutation(size)
                           for e in range(update_epochs)])  # Trainer's order (epoch_permutation)
        params, opt_state = update(params, opt_state, data, orders)
    collector.envs.close()
    return list(collector.envs.return_queue)


def main():
    args = PARSER.parse_args()
    settings = dict(env_id=args.env_id, total_steps=args.total_steps, n_envs=args.n_envs,
                    seed=args.seed)
    steps = args.total_steps // (args.n_envs * 64) * args.n_envs * 64
    print(f"{args.env_id}, {steps} env steps, {args.n_envs} envs x 64 steps, 4 epochs x 4 "
          f"minibatches; {jax.device_count()} {jax.devices()[0].platform} device(s)")
    rows = []
    sides = [("hand-written JAX", lambda: jax_ppo(**settings))]
    if jax.device_count() > 1:
        sides.append(("hand-written, dp", lambda: jax_ppo(**settings, data_parallel=True)))
    sides.append(("redco Trainer", lambda: ppo.train(**settings, workdir=tempfile.mkdtemp(),
                                                     verbose=False)[1]))
    for name, run in sides:
        start = time.perf_counter()
        returns = run()
        seconds = time.perf_counter() - start
        rows.append((name, steps / seconds, seconds, float(np.mean(returns[-20:]))))
        print(f"{name:<18} {steps / seconds:8.0f} env steps/s  ({seconds:6.1f} s)  mean return of "
              f"last 20 episodes {rows[-1][3]:.1f}", flush=True)
    for name, speed, *_ in rows[:-1]:
        print(f"redco / {name}: {rows[-1][1] / speed:.3f}")


if __name__ == "__main__":
    from provenance import print_provenance
    print_provenance()
    main()
