"""A headless Chromium driven over the DevTools protocol on a pipe (the docs site's browser test).

Chromium started with ``--remote-debugging-pipe`` reads DevTools commands on its file descriptor 3
and writes their replies and its events on descriptor 4, each message one JSON object ended by a
NUL byte. That is all this module speaks, which is why it needs no chromedriver (no second process,
no driver/browser version to match), no websocket and no Python package: a command is written with
an ``id``, and messages are read (``select`` with a deadline) until the reply of that ``id``; events
read meanwhile are kept, and the page's uncaught JavaScript exceptions are collected from them.

A page is a target attached in "flat" mode: commands to it carry its ``sessionId``. Waiting is
always for a state or an event, with a deadline: :meth:`Page.goto` reads events until the
navigation's own ``load`` (and takes the HTTP status from its document's response), and
:meth:`Page.wait_for` evaluates a JavaScript expression in the page until it is truthy.

The browser runs in a session of its own (``start_new_session``), and this process is made a
child subreaper, so that the browser's helper processes, orphaned when it exits first, become its
children rather than those of the machine's first process (which in a container may reap
nothing). Closing asks the browser to quit (``Browser.close``), waits for it, then kills and reaps
whatever is left of its session: no Chromium process, zombie or not, outlives the test
(:func:`session_processes` lists them).
"""
import contextlib
import ctypes
import fcntl
import json
import os
import select
import signal
import subprocess
import time
from typing import Any

# Headless, as root in a container: no sandbox (it needs user namespaces), /tmp instead of a small
# /dev/shm, no GPU, nothing fetched from outside (updates, sync, metrics). A window wide enough for
# the site's desktop layout (Material shows the navigation sidebar from 76.25em up).
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--no-first-run", "--no-default-browser-check", "--disable-extensions",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--metrics-recording-only", "--mute-audio", "--window-size=1400,1000",
         "--remote-debugging-pipe")


class DevToolsError(RuntimeError):
    """A DevTools command answered with an error, or no answer came before the deadline."""


class Chromium:
    """One headless Chromium process; :meth:`new_page` opens tabs in it."""

    def __init__(self, binary: str, profile_dir: str, log_path: str):
        cmd_read, self._cmd = os.pipe()
        self._out, out_write = os.pipe()
        # bash puts the pipe ends on descriptors 3 and 4, then becomes Chromium (exec keeps the pid);
        # the ends are first moved above 9, so that neither already is 3 or 4.
        cmd_read, out_write = (_move_above_9(fd) for fd in (cmd_read, out_write))
        script = f'exec "$0" "$@" 3<&{cmd_read} 4>&{out_write} {cmd_read}<&- {out_write}>&-'
        _become_subreaper()
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                ["bash", "-c", script, binary, *FLAGS, f"--user-data-dir={profile_dir}",
                 "about:blank"], pass_fds=(cmd_read, out_write), stdin=subprocess.DEVNULL,
                stdout=log, stderr=log, start_new_session=True)
        os.close(cmd_read)
        os.close(out_write)
        self.log_path = log_path
        self._buffer, self._next_id, self.events = b"", 0, []

    def call(self, method: str, session: str | None = None, timeout: float = 30.0,
             **params: Any) -> dict:
        """Send one command and return its result, reading events until its reply comes."""
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if session is not None:
            message["sessionId"] = session
        os.write(self._cmd, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline, method)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise DevToolsError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def read_event(self, deadline: float, waiting_for: str) -> None:
        """Read one more message (an event: no command is waiting) into :attr:`events`."""
        self.events.append(self._read(deadline, waiting_for))

    def _read(self, deadline: float, waiting_for: str) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._out], [], [], left)[0]:
                raise DevToolsError(f"no reply to {waiting_for} in time (log: {self.log_path})")
            chunk = os.read(self._out, 1 << 20)
            if not chunk:
                raise DevToolsError(f"Chromium exited during {waiting_for} "
                                    f"(exit code {self.process.poll()}, log: {self.log_path})")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def new_page(self) -> "Page":
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        page = Page(self, session)
        for domain in ("Page", "Runtime", "Network"):  # (their events: loads, errors, requests)
            page.call(f"{domain}.enable")
        page.call("Page.setLifecycleEventsEnabled", enabled=True)
        return page

    def close(self, timeout: float = 20.0) -> None:
        """Quit the browser, then kill what is left of its session and reap it all."""
        try:
            self.call("Browser.close", timeout=timeout)
        except (DevToolsError, OSError):
            pass  # it may exit before it answers; what is left is killed below
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout)
        deadline = time.monotonic() + timeout
        while (left := session_processes(self.process.pid)) and time.monotonic() < deadline:
            for pid in left:  # orphans of the browser: this process's children (the subreaper)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):  # (not reparented yet: next pass)
                    os.waitpid(pid, 0)
        os.close(self._cmd)
        os.close(self._out)


class Page:
    """One tab: navigate, evaluate JavaScript, wait for a state."""

    def __init__(self, browser: Chromium, session: str):
        self.browser, self.session = browser, session

    def call(self, method: str, **params: Any) -> dict:
        return self.browser.call(method, session=self.session, **params)

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (awaited if it is a promise)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                           awaitPromise=True)
        if "exceptionDetails" in result:
            raise DevToolsError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, what: str, timeout: float = 30.0) -> Any:
        """Evaluate ``expression`` until it is truthy and return it; fail naming ``what``."""
        deadline = time.monotonic() + timeout
        while not (value := self.evaluate(expression)):
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not so after {timeout:.0f} s ({expression})")
            time.sleep(0.05)  # (the next check of the state, not a wait for time to pass)
        return value

    def goto(self, url: str, timeout: float = 30.0) -> int:
        """Load ``url`` (another document, not an anchor of this one), wait for its ``load``
        event, and return its HTTP status. Both are read from events of this navigation's own
        ``loaderId``: the document's ``Network.responseReceived`` and ``Page.lifecycleEvent``."""
        seen = len(self.browser.events)
        reply = self.call("Page.navigate", url=url)
        if reply.get("errorText"):
            raise AssertionError(f"{url}: {reply['errorText']}")
        deadline = time.monotonic() + timeout
        status, loaded = None, False
        while status is None or not loaded:
            if seen == len(self.browser.events):
                self.browser.read_event(deadline, f"{url} loaded")
            event, seen = self.browser.events[seen], seen + 1
            params = event.get("params", {})
            if event.get("sessionId") != self.session or params.get("loaderId") != reply["loaderId"]:
                continue
            if event["method"] == "Network.responseReceived" and params["type"] == "Document":
                status = params["response"]["status"]
            loaded |= event["method"] == "Page.lifecycleEvent" and params["name"] == "load"
        return status

    def _events(self, method: str) -> list[dict]:
        return [e["params"] for e in self.browser.events
                if e.get("sessionId") == self.session and e.get("method") == method]

    def exceptions(self) -> list[str]:
        """The uncaught JavaScript exceptions the browser reported on this page so far."""
        return [e["exceptionDetails"].get("exception", {}).get("description", str(e))
                for e in self._events("Runtime.exceptionThrown")]

    def requests(self) -> list[str]:
        """The URLs this page requested so far (documents, scripts, workers' fetches...)."""
        return [e["request"]["url"] for e in self._events("Network.requestWillBeSent")]


def _become_subreaper() -> None:
    """Make the browser's orphans (its zygotes, when it exits before them) this process's children
    to reap, not init's: a container's first process may never reap them, leaving zombies."""
    pr_set_child_subreaper = 36  # (linux/prctl.h)
    if ctypes.CDLL(None, use_errno=True).prctl(pr_set_child_subreaper, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def _move_above_9(fd: int) -> int:
    high = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
    os.close(fd)
    return high


def session_processes(session_id: int) -> list[int]:
    """The processes (zombies included) of the session ``session_id`` leads."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # not a process, or it exited while being read
            continue
        if entry.isdigit() and int(fields[3]) == session_id:  # (state, ppid, pgrp, session)
            found.append(int(entry))
    return found
