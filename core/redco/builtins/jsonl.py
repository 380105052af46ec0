"""The default metric logger, ``jsonl``: one JSON object per logged step in
``workdir/metrics.jsonl``."""
from __future__ import annotations

import json
import os

from redco.plugins import hookimpl
from redco.protocols import MetricLogger


class JsonlLogger(MetricLogger):
    def __init__(self, workdir: str):
        super().__init__(workdir)
        self._file = open(os.path.join(workdir, "metrics.jsonl"), "a")

    def log(self, step: int, metrics: dict) -> None:
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


@hookimpl(trylast=True)
def register_loggers(register):
    register("jsonl", JsonlLogger)
