"""The run's log: ``workdir/log.txt``, the terminal, and the metric-logger plugins.

Process 0 writes; the others log warnings only. ``log.txt`` gets every line whether or not the
run is verbose; the terminal gets them when it is. Metrics go to each logger plugin named
(``jsonl``, ``tensorboard``, ``wandb``, a third party's), which a resumed run tells to forget
what it logged after the step it resumed at.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
from typing import Any

import jax

from redco import plugins

logger = logging.getLogger("redco")


class RunLog:
    """Where a run's lines and metrics go (``Deployer`` owns one)."""

    def __init__(self, workdir: str | None, verbose: bool, logger_names: list[str],
                 plugin_options: dict[str, dict]):
        self.workdir, self.verbose, self.metric_loggers = workdir, verbose, []
        self.is_main_process = jax.process_index() == 0
        if not self.is_main_process:
            logger.setLevel(logging.WARNING)
            return
        logger.setLevel(logging.INFO)
        logger.propagate = False
        own_the_log_file(workdir)
        if workdir is None:  # nothing written
            return
        try:
            os.makedirs(workdir, exist_ok=True)
        except OSError as e:
            raise ValueError(f"workdir={workdir!r} cannot be used: {e.strerror}"
                             f"{' (it is a file)' if os.path.isfile(workdir) else ''}. "
                             "Give a directory you can write to.") from e
        if not any(getattr(h, "_redco_workdir", None) == workdir for h in logger.handlers):
            handler = logging.FileHandler(os.path.join(workdir, "log.txt"))
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
            handler._redco_workdir = workdir
            logger.addHandler(handler)
        makers = {name: plugins.lookup("loggers", name) for name in dict.fromkeys(logger_names)}
        self.metric_loggers = [make(workdir, **plugin_options.get(name, {}))
                               for name, make in makers.items()]
        atexit.register(self.close)

    @property
    def show_progress(self) -> bool:
        """Whether this process draws progress bars: process 0, when verbose."""
        return self.is_main_process and self.verbose

    def info(self, info: Any, title: str | None = None, step: int | None = None) -> None:
        """``info`` to ``log.txt`` and, if verbose, the terminal (process 0); with a ``title``
        (and ``step``) as a framed block, as Redco 0.4.x did."""
        message = str(info)
        if title is not None:
            head = f"### {title}" + (f" (step {step})" if step is not None else "")
            rule = "=" * max(len(head), *(len(line) for line in message.splitlines() or [""]))
            message = "\n".join([rule, head, rule.replace("=", "-"), message, rule])
        if self.is_main_process:
            logger.info(message)
        if self.show_progress:
            print(message, flush=True)

    def metrics(self, metrics: dict[str, float], step: int) -> None:
        for metric_logger in self.metric_loggers:
            metric_logger.log(int(step), metrics)

    def save_json(self, name: str, data: Any) -> str | None:
        """``data`` as ``workdir/<name>``; its path (process 0; None with no workdir)."""
        if self.workdir is None or not self.is_main_process:
            return None
        path = os.path.join(self.workdir, name)
        with open(path, "w") as f:
            json.dump(data, f, indent=4)
        return path

    def forget_after(self, step: int) -> None:
        """The run resumed at ``step``: the loggers that can drop what came after it do."""
        for metric_logger in self.metric_loggers:
            if hasattr(metric_logger, "forget_after"):
                metric_logger.forget_after(step)

    def close(self) -> None:
        for metric_logger in self.metric_loggers:
            metric_logger.close()
        self.metric_loggers = []


def own_the_log_file(workdir: str | None) -> None:
    """The newest run in a process writes its own ``log.txt`` only: the file handlers that
    earlier runs (other workdirs) left on the ``redco`` logger are closed and removed, so a
    second ``Deployer`` in one process (a sweep, a notebook) does not write into the first's."""
    for handler in list(logger.handlers):
        if getattr(handler, "_redco_workdir", workdir) != workdir:
            logger.removeHandler(handler)
            handler.close()
