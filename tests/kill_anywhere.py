"""SIGKILL a training command at random moments and rerun it until it finishes: what the zoo's
loops (GRPO, PPO, FedAvg) are tested with against an uninterrupted run of the same command.

The moments: a killed run is let reach a state (wrote a step checkpoint newer than the one it
started from; said it resumed), then killed after a random share (seeded) of a round's time;
so a kill lands anywhere in a round (sampling, updating, writing the next checkpoint, logging)
but after progress was saved, and the rerun must resume. Nothing waits by sleeping: each wait
is on the process or the files, with a deadline.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import jax
import numpy as np

from redco import checkpointing
from redco.sharding import named_leaves

ENV = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_force_host_platform_device_count=8"),
       "HF_HUB_OFFLINE": "1"}


def _newest(workdir: str) -> str | None:
    found = checkpointing.step_ckpts(os.path.join(workdir, "ckpts"))
    return found[-1] if found else None


def run_to_end(cmd: list[str], workdir: str, env: dict = ENV,
               timeout_s: float = 600) -> tuple[str, float]:
    """Run ``cmd`` (training in ``workdir``) to its end (it must succeed); its stdout, and the
    mean seconds between its step checkpoints (the span a kill is spread over; 0 with fewer
    than two)."""
    out = os.path.join(os.path.dirname(workdir), os.path.basename(workdir) + ".out")
    with open(out, "w") as stdout:
        proc = subprocess.Popen(cmd, env=env, stdout=stdout, stderr=subprocess.STDOUT)
    deadline, seen, saved_at = time.monotonic() + timeout_s, None, []
    while proc.poll() is None:
        if _newest(workdir) != seen:
            seen = _newest(workdir)
            saved_at.append(time.monotonic())
        assert time.monotonic() < deadline, f"{cmd} did not end in {timeout_s} s"
        time.sleep(0.02)  # polling the process and the files, not a fixed wait
    text = open(out).read()
    assert proc.returncode == 0, (cmd, text[-5000:])
    return text, (saved_at[-1] - saved_at[0]) / max(1, len(saved_at) - 1)


def saved_a_new_ckpt(workdir: str) -> Callable[[], bool]:
    """A condition: ``workdir`` holds a step checkpoint newer than the newest one now."""
    before = _newest(workdir)
    return lambda: _newest(workdir) != before


def said_resumed(workdir: str) -> Callable[[], bool]:
    """A condition: ``workdir/log.txt`` names one more resume than now."""
    def resumes():
        path = os.path.join(workdir, "log.txt")
        return open(path).read().count("Resumed from") if os.path.exists(path) else 0
    before = resumes()
    return lambda: resumes() > before


def kill_at_random(cmd: list[str], ready: Callable[[], bool], within_s: float,
                   rng: random.Random, env: dict = ENV, timeout_s: float = 600) -> bool:
    """Start ``cmd``; once ``ready()`` holds, SIGKILL it after a random share of ``within_s``
    seconds. False: it ended before the kill."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    try:
        while not ready():
            if proc.poll() is not None:
                return False
            assert time.monotonic() < deadline, f"{cmd} never got to the kill's condition"
            time.sleep(0.05)  # polling the files, not a fixed wait
        proc.wait(timeout=rng.uniform(0, within_s))
        return False
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        return True
    finally:
        proc.kill()
        proc.wait(timeout=timeout_s)


def killed_twice_and_rerun(cmd: Callable[[str], list[str]], tmp_path) -> tuple[str, str, str, str]:
    """Run ``cmd(workdir)`` uninterrupted in ``tmp_path/whole``; in ``tmp_path/cut``, SIGKILL it
    twice at random moments (each after it saved a step checkpoint, within one checkpoint
    interval of the uninterrupted run), then rerun it to its end. Checks that a kill landed and
    that both reruns resumed; returns ``(whole, cut, whole's stdout, cut's last stdout)``."""
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    whole, cut = str(tmp_path / "whole"), str(tmp_path / "cut")
    whole_out, save_every_s = run_to_end(cmd(whole), whole)
    kills = [kill_at_random(cmd(cut), saved_a_new_ckpt(cut), save_every_s, rng) for _ in range(2)]
    cut_out, _ = run_to_end(cmd(cut), cut)
    with open(os.path.join(cut, "log.txt")) as f:
        log = f.read()
    assert sum(kills) >= 1 and log.count("Resumed from") == 2, (seed, kills, log[-2000:])
    print(f"seed {seed}: killed {kills}")  # shown with a failure after this
    return whole, cut, whole_out, cut_out


def newest_step_arrays(workdir: str) -> dict[str, np.ndarray]:
    """``{path: array}`` of the newest step checkpoint in ``workdir/ckpts``: the params, the
    optimizer state and the step, as saved."""
    path = _newest(workdir)
    meta = checkpointing.read_meta(path)
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = checkpointing.nest({name: jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=device)
                                 for name, (shape, dtype) in meta["arrays"].items()})
    tree, _ = checkpointing.load(path, target)
    return {name: np.asarray(x) for name, x in named_leaves(tree)}


def assert_same_arrays(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def redco_cmd(*args: str) -> list[str]:
    """``redco ...`` as this Python runs it."""
    return [sys.executable, "-m", "redco.cli", *args]
