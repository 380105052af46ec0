"""Every update's metrics to the deployer's metric loggers (``metrics.jsonl``, TensorBoard,
W&B, ...): the step's own as ``train/<name>``, what observers added under their own prefix
(``perf/tokens_per_s``)."""
from __future__ import annotations

from redco.plugins import hookimpl


class MetricLogging:
    def __init__(self, trainer):
        pass

    @hookimpl
    def on_step_end(self, trainer, step, metrics):
        trainer.deployer.log_metrics(
            {(key if "/" in key else f"train/{key}"): value for key, value in metrics.items()},
            step)
