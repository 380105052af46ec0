"""Ending a run that hangs: when no train step has finished for ``hang_timeout_s`` seconds
(``Trainer(hang_timeout_s=)``, else ``Deployer(hang_timeout_s=)``, else ``$REDCO_HANG_TIMEOUT``,
else 1800; ``0``/``off``: never),
the process says which process is stuck and at which step, and exits with status 124 (as
``timeout(1)``) instead of waiting forever in a collective whose other side stopped, or on a
deadlocked data loader.

A daemon thread watches while ``Trainer.fit`` trains. A step has finished when its metrics were
read (the step ``metrics.jsonl`` logs). The watch starts at the first finished step of each fit
(the first step compiles, which may take many minutes) and is paused while a checkpoint is written,
the model evaluated, or a callback works in ``trainer.hang_watch_paused()``; after each it starts
again with a full timeout. A pause that names what it waits for (a step checkpoint's save) is a
hang too once it lasts longer than the timeout: the process exits naming it, and the other
processes stop counting it as busy (a save every process does not agree on would otherwise
leave them all waiting for each other, none of them "stuck").

With several processes each one also publishes a heartbeat (wall time, last finished step, paused
or not) in JAX's coordination key-value store, every second (a fifth of the timeout if shorter)
and at once when a step finished. Only a process whose time is up reads them all, with a deadline,
since process 0 hosts the store and may be the stuck one. It names:

* process 0, the coordinator, if the store does not answer;
* else the processes whose heartbeat is older than half the timeout (a stopped or dead process
  publishes nothing; the hosts' clocks must agree to well within that);
* else nobody if one is paused (a long save or evaluation there): the watch goes on;
* else the processes with the lowest last step.

If this process could not publish its heartbeat (said once, as a warning naming the error) or
the store answers the read with an error, it cannot tell who is stuck and says so, naming the
error, instead of blaming a process.

The message goes to stderr (and to ``log.txt`` on process 0), then ``os._exit`` ends the process:
its main thread is stuck.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import os
import sys
import threading
import time
import warnings
from typing import Any, Callable, Iterator

import jax

from redco import _private
from redco.data import check_number

ENV = "REDCO_HANG_TIMEOUT"
DEFAULT_S = 1800.0
EXIT_STATUS = 124  # as timeout(1)
KEY = "redco/watchdog/"


def resolve(setting: float | None) -> float | None:
    """The timeout in seconds for ``Deployer(hang_timeout_s=setting)`` (or ``Trainer``'s), or
    None for none:
    ``setting`` if given, else ``$REDCO_HANG_TIMEOUT``, else ``DEFAULT_S``."""
    if setting is None:
        env = os.environ.get(ENV, str(DEFAULT_S)).strip().lower()
        try:
            setting = 0 if env in ("off", "") else float(env)
        except ValueError:
            raise ValueError(f"{ENV}={env!r}: use a number of seconds, or 0 or off for no "
                             "hang timeout.") from None
        check_number(ENV, setting, 0, integer=False)
    check_number("hang_timeout_s", setting, 0, integer=False)
    return float(setting) or None


def _ask(fn: Callable, seconds: float) -> Any:
    """``fn()``, run in a daemon thread that is left running after ``seconds`` (the store's host
    may be the stuck process): raises what ``fn`` raised, or ``TimeoutError`` if it is late."""
    answer: concurrent.futures.Future = concurrent.futures.Future()

    def call() -> None:
        try:
            answer.set_result(fn())
        except BaseException as error:  # relayed: answer.result raises it in the caller
            answer.set_exception(error)
    threading.Thread(target=call, daemon=True).start()
    return answer.result(seconds)


class Watchdog:
    """Made when ``fit`` starts training, ``stop``ped when it ends; ``progress(step)`` when a step
    finished, ``with paused():`` around long work that is not a step."""

    def __init__(self, timeout_s: float, client: Any = None):
        """``client``: JAX's coordination-service client, by default the run's when it has
        several processes (None: a single process, no heartbeats)."""
        self.timeout = timeout_s
        self.beat = min(1.0, timeout_s / 5)
        self.step: int | None = None
        self.last: float | None = None  # monotonic time of the last progress; None: not watching
        self.waiting: tuple[str, float] | None = None  # a bounded pause: (what, since when)
        self.done, self.changed = threading.Event(), threading.Event()
        self.unpublished: str | None = None  # why the last heartbeat did not get through
        self.said_unpublished = False
        if client is None and jax.process_count() > 1:
            client = _private.coordination_client()
        self.client = client
        threading.Thread(target=self._watch, daemon=True, name="redco-watchdog").start()
        if self.client is not None:
            threading.Thread(target=self._publish, daemon=True, name="redco-heartbeat").start()

    def progress(self, step: int) -> None:
        self.step, self.last = step, time.monotonic()
        self.changed.set()

    @contextlib.contextmanager
    def paused(self, waiting_for: str | None = None) -> Iterator[None]:
        """No step is expected meanwhile; ``waiting_for`` (e.g. "writing step checkpoint
        step_6"): no longer than the timeout either."""
        armed, self.last = self.last is not None, None
        outer, self.waiting = self.waiting, (waiting_for, time.monotonic()) if waiting_for \
            else self.waiting
        try:
            yield
        finally:
            self.last, self.waiting = (time.monotonic() if armed else None), outer

    def _overdue(self) -> str | None:
        """What a bounded pause has waited for longer than the timeout, if it has."""
        waiting = self.waiting
        if waiting is not None and time.monotonic() - waiting[1] >= self.timeout:
            return waiting[0]
        return None

    def stop(self) -> None:
        self.done.set()
        self.changed.set()

    def _publish(self) -> None:
        me = f"{KEY}{jax.process_index()}"
        while not self.done.is_set():
            record = {"time": time.time(), "step": self.step,
                      "paused": self.last is None and self._overdue() is None}
            try:
                _private.key_value_set(self.client, me, json.dumps(record))
                self.unpublished = None
            except jax.errors.JaxRuntimeError as error:  # the store refused or is gone
                self._cannot_publish(error)
            self.changed.wait(self.beat)  # a second, or at once when a step finished
            self.changed.clear()

    def _cannot_publish(self, error: Exception) -> None:
        """Remember why the heartbeat did not get through; warn the first time."""
        self.unpublished = f"{type(error).__name__}: {error}"
        if not self.said_unpublished:
            self.said_unpublished = True
            warnings.warn(f"Process {jax.process_index()} could not publish its hang-watchdog "
                          f"heartbeat in JAX's key-value store ({self.unpublished}). Until one "
                          "gets through, a hang still ends the run, but cannot be pinned on a "
                          "process. (Said once.)", RuntimeWarning, stacklevel=1)

    def _watch(self) -> None:
        while not self.done.wait(self.beat):
            overdue = self._overdue()
            if overdue is not None:
                self._exit(f"Process {jax.process_index()} of {jax.process_count()} has waited "
                           f"{self.timeout:g} s {overdue} (last finished step {self.step}): "
                           "treated as a hang.")
            last = self.last
            if last is None or time.monotonic() - last < self.timeout:
                continue
            stuck = self._stuck() if self.client is not None else "this process"
            if stuck is None or self.done.is_set() or self.last != last:
                continue  # another process is busy saving or evaluating; or progress came
            self._exit(f"No train step finished for {self.timeout:g} s on process "
                       f"{jax.process_index()} of {jax.process_count()} (last finished step "
                       f"{self.step}). Stuck: {stuck}.")

    def _exit(self, what: str) -> None:
        """Say ``what`` hangs and how to go on, then end the process (its main thread is stuck)."""
        message = (f"{what} Exiting with status {EXIT_STATUS}; find out why it hangs, then run "
                   "the same command again to resume from the last step checkpoint "
                   f"(Trainer(hang_timeout_s=), Deployer(hang_timeout_s=) or {ENV} sets the "
                   "timeout).")
        if jax.process_index() == 0:
            logging.getLogger("redco").error(message)  # log.txt
        print(message, file=sys.stderr, flush=True)
        os._exit(EXIT_STATUS)

    def _stuck(self) -> str | None:
        """Who is stuck, from every process's heartbeat; None if one is paused, not stuck."""
        try:
            found = _ask(lambda: _private.key_value_dir_get(self.client, KEY),
                         min(2.0, self.timeout / 4))
        except TimeoutError:
            return "process 0 (the coordinator) does not answer"
        except jax.errors.JaxRuntimeError as error:
            return _blind("read the heartbeats from", f"{type(error).__name__}: {error}")
        if self.unpublished is not None:
            return _blind("publish its heartbeat in", self.unpublished)
        now, records = time.time(), {int(k.rsplit("/", 1)[1]): json.loads(v) for k, v in found}
        silent = [f"process {i} (last step {records[i]['step']}, no heartbeat for "
                  f"{now - records[i]['time']:.0f} s)" if i in records else
                  f"process {i} (no heartbeat yet)" for i in range(jax.process_count())
                  if now - records.get(i, {"time": 0})["time"] > self.timeout / 2]
        if silent:
            return ", ".join(silent)
        if any(r["paused"] for r in records.values()):
            return None
        low = min(r["step"] for r in records.values())
        behind = ", ".join(str(i) for i in sorted(records) if records[i]["step"] == low)
        return f"process {behind} (last step {low}, the lowest; all heartbeats live)"


def _blind(what: str, error: str) -> str:
    """What to say instead of a stuck process when the heartbeats cannot be trusted."""
    return (f"unknown: this process could not {what} JAX's key-value store ({error}), so it "
            "cannot tell which process is hung")
