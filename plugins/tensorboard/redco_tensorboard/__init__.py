"""The ``tensorboard`` metric logger for Redco: ``Deployer(loggers=["jsonl", "tensorboard"])``, or
``Deployer(run_tensorboard=True)`` as in the paper.

Each ``log(step, metrics)`` becomes one TensorBoard event at ``step`` holding a scalar per
metric (``train/loss``, ``eval/loss``, ...), in event files under ``workdir/tensorboard`` that
``tensorboard --logdir workdir/tensorboard`` shows. ``events.py`` encodes them (neither
TensorFlow, tensorboard nor tensorboardX is needed to write them). Each event is written and
flushed before ``log`` returns, so a killed run loses nothing it logged.

Each run, a resumed one too, adds its own event file. Their names carry the time they were
made to the nanosecond (a second writer in the same second must not overwrite the first's file),
so they are read in the order they were written. A run's first event is a ``SessionLog.START``
at its first logged step, TensorBoard's mark of a restart: its event reader
(``EventAccumulator``; ``tensorboard --load_fast=false``) drops what earlier files logged from
that step on, so the steps a resumed run logs again replace those of the run that was killed,
rather than drawing a second line over them.
"""
from __future__ import annotations

import os
import socket
import time

from redco import hookimpl
from redco.protocols import MetricLogger
from redco_tensorboard.events import event, record

SUBDIR = "tensorboard"


class TensorBoardLogger(MetricLogger):
    def __init__(self, workdir: str):
        super().__init__(workdir)
        logdir = os.path.join(workdir, SUBDIR)
        os.makedirs(logdir, exist_ok=True)
        name = f"events.out.tfevents.{time.time_ns()}.{socket.gethostname()}"
        self._file = open(os.path.join(logdir, name), "ab")
        self._write(event(time.time(), 0, file_version="brain.Event:2"))
        self._started = False

    def _write(self, data: bytes) -> None:
        self._file.write(record(data))
        self._file.flush()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self._started:
            self._write(event(time.time(), step, session_start=True))
            self._started = True
        self._write(event(time.time(), step, scalars={tag: float(x) for tag, x in metrics.items()}))

    def close(self) -> None:
        self._file.close()


@hookimpl
def register_loggers(register):
    register("tensorboard", TensorBoardLogger)
