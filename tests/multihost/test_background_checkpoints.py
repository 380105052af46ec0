"""Step checkpoints written in the background with 2 processes (``redco/step_checkpoints.py``):
training goes on while a write is in flight, and a SIGKILL of either process at any moment
(mid-write included) leaves complete checkpoints or ``.tmp`` directories that resume ignores, so
reruns of the same command end with the params of an uninterrupted run, bit for bit.

A write is held deterministically (``bg_ckpt_worker.py``'s ``held:N``): one process's write of
``step_N`` waits once its part is written, and that process is killed at the end of update N+1,
which it reaches only because training went on meanwhile, once the other process's writer has
reached the coordination service's barrier of that save, where it waits for the held one: so
``step_N`` is not renamed into place. The other process is then killed too (as a job scheduler
ends the rest of a job). A SIGTERM with a write held in flight (``term-held:N``) stops both
processes after the same step; the stop waits for the held write before it writes its own.
Neither process announces a checkpoint (``on_checkpoint_saved``) before process 0 has renamed
it into place: each announcement checks so when it is made (``bg_ckpt_worker.py``).
"""
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from multihost_helpers import free_port, worker_env

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bg_ckpt_worker.py")


def start(workdir: str, kills: dict[int, str]) -> tuple[list[subprocess.Popen], list[str]]:
    """Both processes, process ``i`` with ``--kill kills[i]`` where given; their log files."""
    port, procs, logs = free_port(), [], []
    for i in range(2):
        logs.append(f"{workdir}.{len(os.listdir(os.path.dirname(workdir)))}.log")
        with open(logs[-1], "w") as out:
            procs.append(subprocess.Popen(
                [sys.executable, WORKER, str(i), str(port), workdir]
                + (["--kill", kills[i]] if i in kills else []),
                env=worker_env(), stdout=out, stderr=subprocess.STDOUT))
    return procs, logs


def tail(logs: list[str]) -> str:
    """The ends of the processes' logs, less XLA's INFO lines (``I1129 13:48:54...``)."""
    return "\n".join(f"--- {log}:\n" + re.sub(r"(?m)^I\d{4} .*\n", "", open(log).read())[-2500:]
                     for log in logs)


def run(workdir: str) -> None:
    procs, logs = start(workdir, {})
    assert [p.wait(timeout=300) for p in procs] == [0, 0], tail(logs)


def run_killed(workdir: str, victim: int, kill: str) -> None:
    """Run both processes, ``victim`` killed at ``kill``; once it is dead, SIGKILL its partner.
    Checks that the victim died as planned and, for ``held:N``, that ``step_N`` was not put in
    place while its write was held."""
    procs, logs = start(workdir, {victim: kill})
    try:
        code = procs[victim].wait(timeout=300)
    finally:
        procs[1 - victim].kill()
        procs[1 - victim].wait(timeout=60)
    out = open(logs[victim]).read()
    assert code == -9, f"process {victim} ended with {code}, not by its SIGKILL:\n" + tail(logs)
    point, n = kill.split(":")
    if point == "held":
        assert (f"SIGKILL at the end of step {int(n) + 1}, the write of step_{n} held in flight"
                in out), tail(logs)
        assert not os.path.exists(os.path.join(workdir, "ckpts", f"step_{n}")), \
            f"step_{n} was renamed into place while process {victim} still held its write"


def run_stopped(workdir: str, noticed_by: int, kill: str) -> int:
    """Run both processes, ``noticed_by`` sent SIGTERM at ``kill`` (``term-held:N``, the write
    of ``step_N`` held until the trainer waits for it); both must stop after the same step,
    with status 143. Returns that step."""
    procs, logs = start(workdir, {noticed_by: kill})
    assert [p.wait(timeout=300) for p in procs] == [143, 143], tail(logs)
    out, n = open(logs[noticed_by]).read(), int(kill.split(":")[1])
    assert f"SIGTERM before update {n + 1}, the write of step_{n} held in flight" in out, \
        tail(logs)
    assert "still being written" not in out, tail(logs)  # the stop waited for step_N first
    held = os.path.join(workdir, "ckpts", f"step_{n}.tmp", "state")
    assert f"released the write of {held}\n" in out, tail(logs)  # by the stop's wait, in time
    with open(os.path.join(workdir, "log.txt")) as f:
        stops = re.findall(r"Stopped by SIGTERM after step (\d+): saved", f.read())
    assert len(stops) == 1, tail(logs)
    return int(stops[0])


def listing(workdir: str) -> list[str]:
    return sorted(os.listdir(os.path.join(workdir, "ckpts")))


def starts(workdir: str, process: int) -> list[int]:
    with open(os.path.join(workdir, f"starts_{process}.txt")) as f:
        return [int(line) for line in f]


def announced(workdir: str, process: int) -> list[int]:
    """The steps of the checkpoints ``process`` announced, each found in place when it was."""
    with open(os.path.join(workdir, f"announced_{process}.txt")) as f:
        return [int(line) for line in f]


@pytest.mark.parametrize("first_victim", [1, pytest.param(0, marks=pytest.mark.slow)])
def test_two_processes_killed_anywhere_in_background_writes_rerun_to_the_same_bits(
        tmp_path, first_victim):
    """The first kill's victim: process 1, whose partner, the coordinator, waits for it at the
    save's barrier and must not rename ``step_6``; or process 0 (slow tier,
    ``REDCO_SLOW_TESTS=1``), the coordinator itself, whose held write keeps ``step_6`` a
    ``.tmp`` as one process's does: guarded in CI by ``tests/core/test_preemption.py``'s
    ``held:6`` kill, and the barrier by the process 1 case here."""
    # 2 epochs of 4 updates; checkpoints at steps 3, 6 and the epochs' ends 4, 8; 2 kept.
    full, killed = str(tmp_path / "full"), str(tmp_path / "killed")
    run(full)
    assert announced(full, 0) == announced(full, 1) == [3, 4, 6, 8]

    # 1. one process holds its write of step_6 and dies at the end of step 7 (its partner
    #    SIGKILLed then): step_3 and step_4 are complete, step_6 is not.
    run_killed(killed, first_victim, "held:6")
    assert [name for name in listing(killed) if not name.endswith(".tmp")] == ["step_3", "step_4"]

    # 2. from step_4; process 0 holds its write of step_6 and gets SIGTERM at the end of step 7:
    #    both stop after the same step S, step_6 complete before step_S's write began.
    stopped = run_stopped(killed, 0, "term-held:6")
    assert listing(killed) == ["step_6", f"step_{stopped}"]

    # 3. from step_S to the end (S = 7: step_8 written then, the newest 2 kept).
    run(killed)
    assert listing(full) == ["step_6", "step_8"]
    assert listing(killed) == ["step_6" if stopped == 8 else "step_7", "step_8"]
    assert starts(killed, 0) == starts(killed, 1) == [0, 4, stopped]
    want, got = np.load(os.path.join(full, "final.npz")), np.load(os.path.join(killed, "final.npz"))
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
