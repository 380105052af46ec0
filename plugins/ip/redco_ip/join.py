"""What every joining launcher shares: the heartbeat timeout it hands ``jax.distributed``, whether
``Deployer`` process arguments were given (they then decide, whatever the environment), and the
early checks of a process count and id.

Here rather than in ``redco`` because only multi-host launchers need them: the ``ip`` launcher
(``redco_ip``) and the launcher plugins built on this distribution (``redco-slurm``, ...). A
third-party joining launcher depends on ``redco-ip`` (which ``redco`` always installs) and
imports them from here.
"""
from __future__ import annotations

import os

# A process that stops answering is declared lost after this many seconds (jax's default is
# 100); the survivors then stop too, instead of waiting in a collective.
HEARTBEAT_TIMEOUT_S = int(os.environ.get("REDCO_HEARTBEAT_TIMEOUT", 20))

PROCESS_ARGS = ("n_processes", "host0_address", "host0_port", "process_id")


def explicit(config: dict) -> bool:
    """Were ``Deployer`` process arguments given? Then they decide, whatever the environment."""
    return any(config.get(k) is not None for k in PROCESS_ARGS)


def as_int(name: str, value) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} is not an integer.") from None


def check_process_count(n_processes: int, process_id: int, source: str) -> None:
    if n_processes < 1:
        raise ValueError(f"n_processes={n_processes} ({source}) must be at least 1.")
    if not 0 <= process_id < n_processes:
        raise ValueError(
            f"process_id={process_id} but n_processes={n_processes} ({source}): ids run from 0 "
            f"to {n_processes - 1}, one per process. Is the process count the same on every "
            "host?")
