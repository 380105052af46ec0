"""The ``tensorboard`` metric logger for Redco: ``Deployer(loggers=["jsonl", "tensorboard"])``, or
``Deployer(run_tensorboard=True)`` as in the paper.

Each ``log(step, metrics)`` becomes one TensorBoard event at ``step`` holding a scalar per
metric (``train/loss``, ``eval/loss``, ...), in event files under ``workdir/tensorboard`` that
``tensorboard --logdir workdir/tensorboard`` shows. tensorboardX encodes them (neither TensorFlow
nor tensorboard is needed to write them). Its ``EventsWriter`` is used directly, synchronously,
rather than its ``SummaryWriter``, whose background thread holds events in a queue: here each
event is written and flushed before ``log`` returns, so a killed run loses nothing it logged.

Each run, a resumed one too, adds its own event file. Their names carry the time they were
made to the nanosecond (tensorboardX's own names only to the second: a second writer in the same
second would overwrite the first's file), so they are read in the order they were written. A
run's first event is a ``SessionLog.START`` at its first logged step, TensorBoard's mark of a
restart: its event reader (``EventAccumulator``; ``tensorboard --load_fast=false``) drops what
earlier files logged from that step on, so the steps a resumed run logs again replace those of
the run that was killed, rather than drawing a second line over them.
"""
from __future__ import annotations

import os
import time

from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.proto.summary_pb2 import Summary
from tensorboardX.summary import scalar

from redco import hookimpl
from redco.protocols import MetricLogger

SUBDIR = "tensorboard"


class TensorBoardLogger(MetricLogger):
    def __init__(self, workdir: str):
        super().__init__(workdir)
        logdir = os.path.join(workdir, SUBDIR)
        os.makedirs(logdir, exist_ok=True)
        self._events = EventsWriter(os.path.join(logdir, "events"), f".{time.time_ns()}")
        self._started = False

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self._started:
            self._events.write_event(Event(wall_time=time.time(), step=step,
                                           session_log=SessionLog(status=SessionLog.START)))
            self._started = True
        values = [value for tag, x in metrics.items() for value in scalar(tag, x).value]
        self._events.write_event(Event(wall_time=time.time(), step=step,
                                       summary=Summary(value=values)))
        self._events.flush()

    def close(self) -> None:
        self._events.close()


@hookimpl
def register_loggers(register):
    register("tensorboard", TensorBoardLogger)
