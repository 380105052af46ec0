"""Many small updates in one compiled call: every update of several epochs over one set of
examples (an RL rollout: PPO's transitions, GRPO's samples) as a ``lax.scan`` of the train step.

A call of ``Trainer.train_epoch`` per epoch pays, per update, a collate, a transfer onto the
mesh, a dispatch and a metrics read; for updates of a few milliseconds that is most of the
time. Here the examples are collated once, placed once on every device (replicated: a rollout
is small), and one jitted function runs the updates: update ``u`` gathers its minibatch's rows
(``orders[u]``) from the placed examples, constrains them to the batch layout (each device keeps
its own rows: a local slice, no communication) and applies the same step ``train_epoch`` runs,
randomness included (``fold_in(rng, step)``). The minibatches are those ``train_epoch`` would
make: each epoch's shuffled order (``Deployer.epoch_permutation``) cut into global batches, a
last partial one left out. So the params are the same as the epochs run one by one.

One condition: ``collate_fn`` runs once over all the examples, so it must give each example the
same row whatever else is in the batch (fixed-width padding, as RL data has).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from redco.data import check_collated, n_full_batches
from redco.step_reports import report


def minibatch_orders(n_examples: int, batch_size: int, epochs: Sequence[int],
                     permutation: Callable[[int, int], np.ndarray]) -> np.ndarray:
    """(updates, batch_size) int32: the rows of each update, epoch after epoch, each epoch's
    order ``permutation(n_examples, epoch)`` cut into ``batch_size`` rows (a partial last one
    dropped)."""
    n = n_examples // batch_size
    return np.concatenate([permutation(n_examples, epoch)[:n * batch_size].reshape(n, batch_size)
                           for epoch in epochs]).astype(np.int32)


def place_replicated(examples: Sequence, collate_fn: Callable, replicated: NamedSharding) -> Any:
    """All ``examples`` collated once and placed whole on every device (every process must hold
    the same examples)."""
    data = check_collated(collate_fn(list(examples)), len(examples))
    return jax.tree.map(lambda x: jax.make_array_from_callback(
        np.shape(x), replicated, lambda index: np.asarray(x)[index]), data)


def scan_updates(step: Callable, mesh, n_micro: int) -> Callable:
    """``updates(state, data, orders) -> (state, metrics)``: ``step(state, batch)`` once per row
    of ``orders``, the batch that row's examples of ``data`` split into ``n_micro``
    micro-batches (the step's leading axis), laid out over ``dp`` as ``Deployer.make_batch``
    lays a batch out; ``metrics`` stacked, one row per update."""
    def updates(state, data, orders):
        def one(state, rows):
            def take(x):
                batch = x[rows.reshape(n_micro, -1)]
                dp = "dp" if batch.shape[1] % mesh.shape["dp"] == 0 else None
                return jax.lax.with_sharding_constraint(batch, NamedSharding(mesh, P(None, dp)))
            return step(state, jax.tree.map(take, data))
        return jax.lax.scan(one, state, orders)
    return updates


def train_scanned(trainer: Any, examples: Sequence, per_device_batch_size: int,
                  epochs: Sequence[int], desc: str = "",
                  during: Callable[[], Any] | None = None) -> None:
    """``Trainer.train_scanned``: every update of ``epochs`` over ``examples`` in one compiled
    call (module docstring); ``during()`` runs once the call is dispatched, before its metrics
    are read (other devices' work, on this thread, while the updates run); observers see each
    update (``on_step_end``) once it returns."""
    trainer.prepare(examples, per_device_batch_size)
    size = trainer.deployer.get_global_batch_size(per_device_batch_size)
    size *= trainer.accumulate_grad_batches
    n_full_batches(examples, size, "train_examples")
    orders = minibatch_orders(len(examples), size, epochs, trainer.deployer.epoch_permutation)
    first, replicated = trainer.step, trainer.deployer.replicated
    trainer.hooks.on_epoch_start(trainer=trainer, epoch=epochs[0], start=0, n_steps=len(orders),
                                 desc=desc, examples_per_step=orders.shape[1])
    start = time.perf_counter()
    compiling = trainer.steps.scanned is None
    if compiling:
        trainer.steps.scanned = jax.jit(
            scan_updates(trainer.steps.step(), trainer.deployer.mesh, trainer.accumulate_grad_batches),
            in_shardings=(trainer.state_shardings, replicated, replicated),
            out_shardings=(trainer.state_shardings, replicated), donate_argnums=0)
    data = place_replicated(examples, trainer.collate_fn, replicated)
    trainer.state, metrics = trainer.steps.scanned(trainer.state, data, place_replicated(
        orders, np.stack, replicated))
    if during is not None:
        during()
    metrics, seconds = jax.device_get(metrics), time.perf_counter() - start
    for u in range(len(orders)):
        trainer.hooks.on_time_spent(trainer=trainer, phase="compile" if compiling and u == 0
                                    else "step", seconds=seconds / len(orders), step=first + u + 1)
        report(trainer, first + u + 1, {k: v[u] for k, v in metrics.items()})
    trainer.hooks.on_epoch_end(trainer=trainer, epoch=epochs[-1])
