"""Goodput: where the wall time of a run went, summed over every restart of one workdir.

Each ``fit`` is split into the phases the loop times (``on_time_spent``): ``startup`` (checks,
layout, placement, resume, sanity check), ``compile``, ``data`` (collating and placing batches;
this overlaps the device's previous update), ``steps`` (updates), ``replayed`` (the data and
update time of steps an earlier run had already reached before it was stopped or killed: the
work lost since its last checkpoint), ``checkpoint``, ``evaluation``, ``rollout`` (an RL loop's
sampling and scoring, ``run.timed("rollout")``) and ``other`` (the rest: logging, callbacks).
``goodput`` is ``steps`` over the wall time. A ``trainer.run()`` is recorded as a fit is.

``workdir/goodput.json`` (process 0) holds every run's record and their ``total``. It is
rewritten at least every ``$REDCO_GOODPUT_EVERY_S`` seconds (default 10) of training, after
each checkpoint and at the end of fit, so a run killed without warning loses at most that much
of its record. A summary line goes to the log at the end of fit.
"""
from __future__ import annotations

import json
import os
import time

from redco.plugins import hookimpl

PHASES = ("startup", "compile", "data", "steps", "replayed", "checkpoint", "evaluation",
          "rollout")
FILE = "goodput.json"


def every_s() -> float:
    return float(os.environ.get("REDCO_GOODPUT_EVERY_S", "10"))


def read_runs(path: str) -> list[dict]:
    """The runs recorded at ``path`` (none if it is missing or was cut short)."""
    try:
        with open(path) as f:
            return json.load(f)["runs"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return []


def total(runs: list[dict]) -> dict:
    """The runs' phases, wall time and replayed steps summed; ``goodput`` = steps / wall."""
    keys = (*PHASES, "other", "wall", "replayed_steps")
    summed = {key: sum(run.get(key, 0.0) for run in runs) for key in keys}  # (older: no rollout)
    summed["goodput"] = summed["steps"] / summed["wall"] if summed["wall"] else 0.0
    return summed


class Goodput:
    def __init__(self, trainer):
        self.run: dict | None = None  # this fit's record, while it runs
        self.earlier: list[dict] = []
        self.reached = 0  # the furthest step an earlier run of this workdir finished
        self.started = self.written = 0.0

    def path(self, trainer) -> str | None:
        deployer = trainer.deployer
        if deployer.workdir is None or not deployer.is_main_process:
            return None
        return os.path.join(deployer.workdir, FILE)

    def begin(self, trainer, started: float) -> None:
        """At fit's startup phase: a new record from ``started``; what earlier runs reached."""
        path = self.path(trainer)
        self.earlier = read_runs(path) if path else []
        self.reached = max((run["last_step"] for run in self.earlier), default=0)
        self.started = self.written = started
        self.run = {"started": self.started, **dict.fromkeys(PHASES, 0.0), "other": 0.0,
                    "wall": 0.0, "first_step": trainer.step, "last_step": trainer.step,
                    "replayed_steps": 0}

    @hookimpl
    def on_time_spent(self, trainer, phase, seconds, step):
        if self.run is None:  # train_epoch called outside fit: nothing recorded
            if phase != "startup":
                return
            self.begin(trainer, time.time() - seconds)
        replayed = phase in ("data", "step") and step is not None and step <= self.reached
        self.run["replayed" if replayed else "steps" if phase == "step" else phase] += seconds

    @hookimpl
    def on_step_end(self, trainer, step):
        if self.run is None:
            return
        self.run["last_step"] = step
        self.run["replayed_steps"] = max(0, min(step, self.reached) - self.run["first_step"])
        if time.time() - self.written >= every_s():
            self.write(trainer)

    @hookimpl
    def on_checkpoint_saved(self, trainer):
        if self.run is not None:
            self.write(trainer)

    @hookimpl
    def on_run_start(self, trainer):
        if self.run is None:
            self.begin(trainer, time.time())

    @hookimpl
    def on_run_end(self, trainer):
        self.on_fit_end(trainer)

    @hookimpl
    def on_fit_end(self, trainer):
        if self.run is None:
            return
        summed = self.write(trainer)
        trainer.deployer.log_info(
            f"goodput {summed['goodput']:.1%} of {summed['wall']:.1f} s over "
            f"{len(self.earlier) + 1} run(s): " +
            ", ".join(f"{key} {summed[key]:.1f} s" for key in (*PHASES, "other")) +
            f"; {summed['replayed_steps']} steps replayed")
        self.run = None

    def write(self, trainer) -> dict:
        """This run's record brought up to now, written with the earlier ones and their total
        (atomically); returns the total."""
        now = time.time()
        self.run["wall"] = now - self.started
        self.run["other"] = max(0.0, self.run["wall"] - sum(self.run[k] for k in PHASES))
        runs = [*self.earlier, self.run]
        summed = total(runs)
        path = self.path(trainer)
        if path is not None:
            with open(path + ".tmp", "w") as f:
                json.dump({"total": summed, "runs": runs}, f, indent=1)
            os.replace(path + ".tmp", path)
        self.written = now
        return summed
