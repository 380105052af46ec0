"""A third-party-style Redco plugin: ``Deployer(loggers=["jsonl", "csv"])`` also writes
``workdir/metrics.csv`` (one row per logged step and metric)."""
from __future__ import annotations

import csv
import os

import redco


class CsvLogger:
    def __init__(self, workdir: str):
        path = os.path.join(workdir, "metrics.csv")
        new = not os.path.exists(path)
        self._file = open(path, "a", newline="")
        self._writer = csv.writer(self._file)
        if new:
            self._writer.writerow(["step", "metric", "value"])

    def log(self, step: int, metrics: dict) -> None:
        self._writer.writerows([step, name, value] for name, value in metrics.items())
        self._file.flush()

    def close(self) -> None:
        self._file.close()


@redco.hookimpl
def register_loggers(register):
    register("csv", CsvLogger)
