"""The built-in observers of a training run (``redco/observers/``), registered as any plugin's
would be; a plugin registering one of these names replaces it."""
from __future__ import annotations

from redco.observers.best_checkpoints import BestCheckpoints
from redco.observers.goodput import Goodput
from redco.observers.metric_logging import MetricLogging
from redco.observers.profiler import Profiler
from redco.observers.progress_bar import ProgressBar
from redco.observers.throughput import Throughput
from redco.plugins import hookimpl


@hookimpl(trylast=True)
def register_observers(register):
    register("throughput", Throughput)
    register("metric_logging", MetricLogging)
    register("progress_bar", ProgressBar)
    register("goodput", Goodput)
    register("profiler", Profiler)
    register("best_checkpoints", BestCheckpoints)
