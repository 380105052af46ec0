"""The default metric logger, ``jsonl``: one JSON object per logged step in
``workdir/metrics.jsonl``, with its wall time (``time``, seconds since the epoch)."""
from __future__ import annotations

import json
import os
import time

from redco.plugins import hookimpl
from redco.protocols import MetricLogger


class JsonlLogger(MetricLogger):
    def __init__(self, workdir: str):
        super().__init__(workdir)
        self._path = os.path.join(workdir, "metrics.jsonl")
        self._file = open(self._path, "a")

    def log(self, step: int, metrics: dict) -> None:
        self._file.write(json.dumps({"step": step, "time": round(time.time(), 3), **metrics}) + "\n")
        self._file.flush()

    def forget_after(self, step: int) -> None:
        """Keep the rows up to ``step`` (a line a kill cut short is dropped too), rewritten
        atomically: after a resume the file reads like an uninterrupted run's."""
        self._file.close()
        with open(self._path) as f:
            rows = [row for row in map(_parse, f) if row is not None and row["step"] <= step]
        with open(self._path + ".tmp", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        os.replace(self._path + ".tmp", self._path)
        self._file = open(self._path, "a")

    def close(self) -> None:
        self._file.close()


def _parse(line: str) -> dict | None:
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


@hookimpl(trylast=True)
def register_loggers(register):
    register("jsonl", JsonlLogger)
