"""The built-in launcher ``local``: a single process, nothing to join. It is the fallback, tried
after every other launcher (``ip`` from ``redco-ip``, ``slurm`` from ``redco-slurm``, ...)."""
from __future__ import annotations

from redco.plugins import hookimpl
from redco.protocols import Launcher


class LocalLauncher(Launcher):
    """A single process: nothing to join."""

    def detect(self, config: dict) -> bool:
        return True

    def explain(self, config: dict) -> str:
        return "one process (the fallback)"

    def initialize(self, config: dict) -> None:
        pass


@hookimpl(trylast=True)
def register_launchers(register):
    register("local", LocalLauncher())
