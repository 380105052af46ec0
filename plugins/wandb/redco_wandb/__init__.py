"""The ``wandb`` metric logger for Redco: ``Deployer(wandb_init_kwargs={"project": ...})``, as
in Redco 0.4, or ``Deployer(loggers=["jsonl", "wandb"])`` with ``wandb.init``'s defaults.

On process 0 it calls ``wandb.init(**wandb_init_kwargs)`` (``dir`` defaults to the workdir) and
sends each ``log(step, metrics)`` as ``wandb.log(metrics, step=step)``. Without a network,
``WANDB_MODE=offline`` keeps the run on disk for ``wandb sync`` later. wandb is imported when
a run logs to it, not whenever the plugin is registered (every redco start; its import is
heavy).
"""
from __future__ import annotations

from redco import hookimpl
from redco.protocols import MetricLogger


class WandbLogger(MetricLogger):
    needs_setup = True  # an account and a project: only when named

    def __init__(self, workdir: str, **init_kwargs):
        super().__init__(workdir)
        import wandb
        self.run = wandb.init(**{"dir": workdir, **init_kwargs})

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


@hookimpl
def register_loggers(register):
    register("wandb", WandbLogger)
