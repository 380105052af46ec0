"""Ending a run that hangs: when no train step has finished for ``hang_timeout_s`` seconds
(``Deployer(hang_timeout_s=)``, else ``$REDCO_HANG_TIMEOUT``, else 1800; ``0``/``off``: never),
the process says which process is stuck and at which step, and exits with status 124 (as
``timeout(1)``) instead of waiting forever in a collective whose other side stopped, or on a
deadlocked data loader.

A daemon thread watches while ``Trainer.fit`` trains. A step has finished when its metrics were
read (the step ``metrics.jsonl`` logs). The watch starts at the first finished step of each fit
(the first step compiles, which may take many minutes) and is paused while a checkpoint is written,
the model evaluated, or a callback works in ``trainer.hang_watch_paused()``; after each it starts
again with a full timeout.

With several processes each one also publishes a heartbeat (wall time, last finished step, paused
or not) in JAX's coordination key-value store, every second (a fifth of the timeout if shorter)
and at once when a step finished. Only a process whose time is up reads them all, with a deadline,
since process 0 hosts the store and may be the stuck one. It names:

* process 0, the coordinator, if the store does not answer;
* else the processes whose heartbeat is older than half the timeout (a stopped or dead process
  publishes nothing; the hosts' clocks must agree to well within that);
* else nobody if one is paused (a long save or evaluation there): the watch goes on;
* else the processes with the lowest last step.

The message goes to stderr (and to ``log.txt`` on process 0), then ``os._exit`` ends the process:
its main thread is stuck.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time
from typing import Callable, Iterator

import jax
from jax._src import distributed

from redco.data import check_number

ENV = "REDCO_HANG_TIMEOUT"
DEFAULT_S = 1800.0
EXIT_STATUS = 124  # as timeout(1)
KEY = "redco/watchdog/"


def resolve(setting: float | None) -> float | None:
    """The timeout in seconds for ``Deployer(hang_timeout_s=setting)``, or None for none:
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


def _ask(fn: Callable, seconds: float):
    """``fn()``, or None when it fails or takes longer than ``seconds`` (it is left running)."""
    out = []

    def call() -> None:
        with contextlib.suppress(Exception):
            out.append(fn())
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    return out[0] if out else None


class Watchdog:
    """Made when ``fit`` starts training, ``stop``ped when it ends; ``progress(step)`` when a step
    finished, ``with paused():`` around long work that is not a step."""

    def __init__(self, timeout_s: float):
        self.timeout = timeout_s
        self.beat = min(1.0, timeout_s / 5)
        self.step: int | None = None
        self.last: float | None = None  # monotonic time of the last progress; None: not watching
        self.done, self.changed = threading.Event(), threading.Event()
        self.client = distributed.global_state.client if jax.process_count() > 1 else None
        threading.Thread(target=self._watch, daemon=True, name="redco-watchdog").start()
        if self.client is not None:
            threading.Thread(target=self._publish, daemon=True, name="redco-heartbeat").start()

    def progress(self, step: int) -> None:
        self.step, self.last = step, time.monotonic()
        self.changed.set()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        armed, self.last = self.last is not None, None
        try:
            yield
        finally:
            self.last = time.monotonic() if armed else None

    def stop(self) -> None:
        self.done.set()
        self.changed.set()

    def _publish(self) -> None:
        me = f"{KEY}{jax.process_index()}"
        while not self.done.is_set():
            record = {"time": time.time(), "step": self.step, "paused": self.last is None}
            with contextlib.suppress(Exception):  # the coordinator may be gone: _watch says so
                self.client.key_value_set(me, json.dumps(record), allow_overwrite=True)
            self.changed.wait(self.beat)  # a second, or at once when a step finished
            self.changed.clear()

    def _watch(self) -> None:
        while not self.done.wait(self.beat):
            last = self.last
            if last is None or time.monotonic() - last < self.timeout:
                continue
            stuck = self._stuck() if self.client is not None else "this process"
            if stuck is None or self.done.is_set() or self.last != last:
                continue  # another process is busy saving or evaluating; or progress came
            message = (f"No train step finished for {self.timeout:g} s on process "
                       f"{jax.process_index()} of {jax.process_count()} (last finished step "
                       f"{self.step}). Stuck: {stuck}. Exiting with status {EXIT_STATUS}; "
                       "find out why it hangs, then run the same command again to resume from "
                       f"the last step checkpoint (Deployer(hang_timeout_s=) or {ENV} sets the "
                       "timeout).")
            if jax.process_index() == 0:
                logging.getLogger("redco").error(message)  # log.txt
            print(message, file=sys.stderr, flush=True)
            os._exit(EXIT_STATUS)

    def _stuck(self) -> str | None:
        """Who is stuck, from every process's heartbeat; None if one is paused, not stuck."""
        found = _ask(lambda: self.client.key_value_dir_get(KEY), min(2.0, self.timeout / 4))
        if found is None:
            return "process 0 (the coordinator) does not answer"
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
