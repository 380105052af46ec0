"""What a rollout's 16 PPO updates cost in pure JAX on one device and on 8 simulated ones,
side by side in one run: the layout's own price, apart from any framework. The network, loss and
optimizer are ``redco_zoo_ppo``'s (CartPole sizes: 1,024 transitions, minibatches of 256, 4
epochs); each side is one jitted ``lax.scan`` over the 16 minibatches, timed over 50 calls after
one to compile.

Layouts: ``1 device``; ``dp``: params and rollout replicated over 8 devices, each minibatch
split over them (a gradient all-reduce per update); ``replicated``: every device computes the
whole minibatch (no collective).

Run:  python bench/ppo_update_layouts.py 2>/dev/null
"""
from __future__ import annotations

import os

if __name__ == "__main__":  # before jax starts
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import redco_zoo_ppo.pipeline as ppo  # noqa: E402


class State:
    apply_fn = staticmethod(ppo.apply_fn)


def ms_per_call(devices, split: bool) -> float:
    """Milliseconds per call of the 16 updates on ``devices``; ``split``: minibatches over dp."""
    mesh = Mesh(np.array(devices), ("dp",))
    replicated = NamedSharding(mesh, P())
    tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-3, eps=1e-5))
    rng = np.random.default_rng(0)
    data = {"obs": rng.normal(size=(1024, 4)).astype(np.float32),
            "action": rng.integers(0, 2, 1024).astype(np.int32),
            "logp": np.zeros(1024, np.float32), "adv": rng.normal(size=1024).astype(np.float32),
            "ret": rng.normal(size=1024).astype(np.float32)}
    orders = np.stack([rng.permutation(1024) for _ in range(4)]).reshape(16, 256).astype(np.int32)

    def updates(params, opt_state, data, orders):
        def one(carry, rows):
            params, opt_state = carry
            batch = jax.tree.map(lambda x: x[rows], data)
            if split:
                batch = jax.lax.with_sharding_constraint(batch, NamedSharding(mesh, P("dp")))
            grads = jax.grad(lambda p: ppo.loss_fn(None, State, p, batch, True))(params)
            step, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, step), opt_state), None
        return jax.lax.scan(one, (params, opt_state), orders)[0]
    run = jax.jit(updates, in_shardings=replicated, out_shardings=replicated)
    params = ppo.init_params(jax.random.PRNGKey(0), 4, 2)
    params, opt_state = jax.device_put((params, tx.init(params)), replicated)
    data, orders = jax.device_put((data, orders), replicated)
    params, opt_state = jax.block_until_ready(run(params, opt_state, data, orders))
    start = time.perf_counter()
    for _ in range(50):
        params, opt_state = run(params, opt_state, data, orders)
    jax.block_until_ready(params)
    return (time.perf_counter() - start) / 50 * 1000


def main() -> None:
    one = ms_per_call(jax.devices()[:1], split=False)
    print("| layout | ms per 16 updates | / 1 device |\n|---|---:|---:|")
    for name, ms in [("1 device", one), ("dp over 8", ms_per_call(jax.devices(), True)),
                     ("replicated over 8", ms_per_call(jax.devices(), False))]:
        print(f"| {name} | {ms:.1f} | {ms / one:.1f} |")


if __name__ == "__main__":
    from provenance import print_provenance
    print_provenance()
    main()
