"""Built-in launchers: ``ip`` (bare hosts named by address, port and process id) and ``local``
(one process; the fallback)."""
from __future__ import annotations

import jax

from redco.plugins import hookimpl


class IPLauncher:
    """Hosts reached by IP: ``Deployer(n_processes=, host0_address=, host0_port=, process_id=)``."""

    def detect(self, config: dict) -> bool:
        return config.get("n_processes") not in (None, 1)

    def initialize(self, config: dict) -> None:
        missing = [k for k in ("host0_address", "host0_port", "process_id") if config.get(k) is None]
        if missing:
            raise ValueError(f"n_processes={config['n_processes']} needs {missing} as well: "
                             "every process must know host 0's address and port, and its own id.")
        local = config.get("n_local_devices")
        jax.distributed.initialize(
            coordinator_address=f"{config['host0_address']}:{config['host0_port']}",
            num_processes=config["n_processes"], process_id=config["process_id"],
            local_device_ids=list(range(local)) if local else None)


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
