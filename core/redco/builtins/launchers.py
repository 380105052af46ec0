"""Built-in launchers: ``ip`` (bare hosts named by address, port and process id) and ``local``
(one process; the fallback)."""
from __future__ import annotations

import os
import socket

import jax

from redco.plugins import hookimpl

# A process that stops answering is declared lost after this many seconds (jax's default is
# 100); the survivors then stop too, instead of waiting in a collective.
HEARTBEAT_TIMEOUT_S = int(os.environ.get("REDCO_HEARTBEAT_TIMEOUT", 20))


def check_port_free(port: int) -> None:
    """Process 0 serves the coordinator on ``port``: refuse a busy one before jax hangs on it."""
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError as e:
            raise RuntimeError(
                f"host0_port={port} is already in use on this host ({e.strerror}): is another "
                "run still going? Stop it, or give every process another host0_port.") from e


class IPLauncher:
    """Hosts reached by IP: ``Deployer(n_processes=, host0_address=, host0_port=, process_id=)``."""

    def detect(self, config: dict) -> bool:
        return config.get("n_processes") not in (None, 1)

    def initialize(self, config: dict) -> None:
        missing = [k for k in ("host0_address", "host0_port", "process_id") if config.get(k) is None]
        if missing:
            raise ValueError(f"n_processes={config['n_processes']} needs {missing} as well: "
                             "every process must know host 0's address and port, and its own id.")
        if config["process_id"] == 0:
            check_port_free(config["host0_port"])
        local = config.get("n_local_devices")
        jax.distributed.initialize(
            coordinator_address=f"{config['host0_address']}:{config['host0_port']}",
            num_processes=config["n_processes"], process_id=config["process_id"],
            local_device_ids=list(range(local)) if local else None,
            heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S)


class LocalLauncher:
    """A single process: nothing to join."""

    def detect(self, config: dict) -> bool:
        return True

    def initialize(self, config: dict) -> None:
        pass


@hookimpl(trylast=True)
def register_launchers(register):
    register("ip", IPLauncher())
    register("local", LocalLauncher())
