"""Every private JAX and optax API redco's library code uses, and only here.

Each function wraps one private thing that has no public equivalent, says why redco needs it,
and is checked against the installed JAX and optax by ``tests/core/test_private_apis.py``
(the symbol exists, with the signature and the behaviour relied on): an upgrade that changes one
fails there, by name, instead of somewhere in a run. Nothing here catches errors: a caller
decides which failures of the service behind it it can survive.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import optax
from jax._src import config as jax_config
from jax._src import distributed


def coordination_client() -> Any:
    """JAX's coordination-service client, ``jax._src.distributed.global_state.client`` (None
    before ``jax.distributed.initialize``). JAX has no public handle on its key-value store or
    its list of live processes: the hang watchdog publishes heartbeats there, and the deployer
    asks it which process was lost."""
    return distributed.global_state.client


def key_value_set(client: Any, key: str, value: str) -> None:
    """``client.key_value_set(key, value, allow_overwrite=True)``: set ``key``, replacing any
    earlier value (a heartbeat). Errors of the service raise ``jax.errors.JaxRuntimeError``."""
    client.key_value_set(key, value, allow_overwrite=True)


def key_value_dir_get(client: Any, prefix: str) -> list[tuple[str, str]]:
    """``client.key_value_dir_get(prefix)``: every ``(key, value)`` under ``prefix``."""
    return list(client.key_value_dir_get(prefix))


def wait_at_barrier(client: Any, name: str, timeout_ms: int) -> None:
    """``client.wait_at_barrier(name, timeout_ms)``: return once every process reached the
    barrier ``name`` (used once per name). Unlike ``multihost_utils.sync_global_devices`` it runs
    nothing on the devices, so a writer thread can wait there while training runs collectives;
    JAX has no public barrier of the coordination service."""
    client.wait_at_barrier(name, timeout_ms)


def live_processes(client: Any, n_processes: int) -> list[int]:
    """The ids among ``range(n_processes)`` that the coordination service still hears from,
    ``client.get_live_nodes(ids)`` (a dict keyed by process id)."""
    return sorted(client.get_live_nodes(list(range(n_processes))))


def preemption_service_on() -> bool:
    """Whether JAX's preemption service runs (``jax_enable_preemption_service``, on by default in
    ``jax.distributed`` runs): ``jax._src.distributed.global_state.preemption_sync_manager`` is
    set. Public JAX only offers ``reached_preemption_sync_point``, which fails without it."""
    return distributed.global_state.preemption_sync_manager is not None


def enum_config_state(name: str, values: Sequence[str], default: str, help: str) -> Any:
    """A JAX config option of the strings ``values`` that ``jax.jit`` keys its caches on and
    traces see, ``jax._src.config.enum_state(..., include_in_jit_key=True,
    include_in_trace_context=True)``: ``state.value`` reads it, ``with state(value):`` sets it
    (thread-locally), ``$NAME`` (upper case) sets the default. Public ``jax.config`` can only
    update JAX's own options, so ``redco.remat``'s policy could not change what jit compiles."""
    return jax_config.enum_state(name, list(values), default, help,
                                 include_in_jit_key=True, include_in_trace_context=True)


def multisteps_every_k(optimizer: optax.MultiSteps) -> int:
    """How many mini-batches an ``optax.MultiSteps`` accumulates (its schedule at step 0): it
    keeps ``every_k_schedule`` only as the private ``_every_k_schedule``, a function of the
    step (an int given to it becomes a constant function)."""
    return int(optimizer._every_k_schedule(0))


def slurm_coordinator_address() -> str | None:
    """The coordinator JAX's SLURM detection derives from ``$SLURM_STEP_NODELIST`` and
    ``$SLURM_JOB_ID`` (``$JAX_COORDINATOR_PORT`` overrides the port), from
    ``jax._src.clusters.SlurmCluster.get_coordinator_address``, the code ``jax.distributed``
    itself runs (its node-list parsing is not public); None outside a job step."""
    if "SLURM_STEP_NODELIST" not in os.environ or "SLURM_JOB_ID" not in os.environ:
        return None
    from jax._src.clusters import SlurmCluster  # only the slurm launcher's explain asks
    return SlurmCluster.get_coordinator_address(
        timeout_secs=None, override_coordinator_port=os.environ.get("JAX_COORDINATOR_PORT"))
