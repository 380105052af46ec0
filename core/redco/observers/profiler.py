"""A JAX profiler trace of chosen updates, for TensorBoard's profile plugin or Perfetto.

``fit(profile_steps=(start, stop))``, or ``$REDCO_PROFILE_STEPS=start:stop`` for a script left
unchanged, traces updates ``start`` to ``stop`` (1-based, inclusive) into
``workdir/profile/plugins/profile/<time>/`` (an ``.xplane.pb`` and a Perfetto
``.trace.json.gz``): on process 0 only, or on every process with
``$REDCO_PROFILE_PROCESSES=all`` (each writes its own host's file). Each update shows as a
``train_step`` event with its ``step_num``. The trace starts before ``start``'s batch is
collated and stops once ``stop``'s metrics are read. A trace grows with the steps and the
host work in them, and is held in host memory until written: keep the window to a few steps.
"""
from __future__ import annotations

import os

import jax

from redco.plugins import hookimpl

STEPS_ENV, PROCESSES_ENV = "REDCO_PROFILE_STEPS", "REDCO_PROFILE_PROCESSES"


def profile_window(profile_steps, first_step: int, last_step: int | None,
                   workdir: str | None) -> tuple[int, int] | None:
    """``profile_steps`` (else ``$REDCO_PROFILE_STEPS``) checked against the updates this fit
    runs, ``first_step`` to ``last_step`` (None: not known yet, not checked); an error saying
    what to pass instead."""
    source = "fit(profile_steps=...)"
    if profile_steps is None and os.environ.get(STEPS_ENV):
        source, text = f"${STEPS_ENV}", os.environ[STEPS_ENV]
        try:
            profile_steps = tuple(int(part) for part in text.split(":"))
        except ValueError:
            profile_steps = text
    if profile_steps is None:
        return None
    if (not isinstance(profile_steps, (tuple, list)) or len(profile_steps) != 2
            or not all(isinstance(s, int) for s in profile_steps)):
        raise ValueError(f"{source} is {profile_steps!r}: give two update numbers, (start, stop) "
                         f"(or {STEPS_ENV}=start:stop), e.g. (10, 12).")
    start, stop = profile_steps
    if not first_step <= start <= stop <= (stop if last_step is None else last_step):
        runs = f"{first_step} on" if last_step is None else f"{first_step} to {last_step}"
        raise ValueError(f"{source} asks for updates {start} to {stop}, but this fit runs updates "
                         f"{runs}: give 1-based (start, stop) with start <= stop inside that "
                         "range.")
    if workdir is None:
        raise ValueError(f"{source} writes its trace under the workdir, but this Deployer has "
                         "workdir=None. Give it a workdir.")
    return start, stop


class Profiler:
    def __init__(self, trainer):
        self.window: tuple[int, int] | None = None
        self.tracing = False

    @hookimpl
    def on_fit_start(self, trainer, fit_options):
        here = jax.process_index() == 0 or os.environ.get(PROCESSES_ENV) == "all"
        self.window = fit_options.get("profile_window") if here else None

    @hookimpl
    def on_train_batch_start(self, trainer, step):
        if self.window and not self.tracing and self.window[0] <= step <= self.window[1]:
            jax.profiler.start_trace(os.path.join(trainer.deployer.workdir, "profile"),
                                     create_perfetto_trace=True)
            self.tracing = True

    @hookimpl
    def on_step_end(self, trainer, step):
        if self.tracing and step >= self.window[1]:
            self.stop(trainer)

    @hookimpl
    def on_fit_end(self, trainer):
        if self.tracing:
            self.stop(trainer)
        self.window = None

    def stop(self, trainer) -> None:
        jax.profiler.stop_trace()
        self.tracing = False
        trainer.deployer.log_info(f"Profile of updates {self.window[0]} to {self.window[1]} "
                                  f"written under {trainer.deployer.workdir}/profile")
