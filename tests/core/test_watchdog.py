"""A run that stops making progress ends by itself (exit status 124) within twice its hang
timeout, naming its last finished step; a slow first compile, slow checkpoints and a slow
evaluation do not count as a hang. Real processes (``hang_worker.py``), no mocks. The
multi-process case (a SIGSTOPped process named by the other) is in tests/multihost."""
import json
import os
import re
import subprocess
import sys
import time

import pytest

from redco import Deployer

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hang_worker.py")
TIMEOUT_S = 3


def run_worker(workdir: str, mode: str, timeout_s: float = TIMEOUT_S):
    """The worker, run to its end: (exit status, output, wall time when it ended)."""
    os.makedirs(workdir)
    env = dict(os.environ, REDCO_HANG_TIMEOUT=str(timeout_s), HF_HUB_OFFLINE="1")
    proc = subprocess.Popen([sys.executable, WORKER, workdir, mode], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out = proc.communicate(timeout=300)[0]
    finally:
        proc.kill()
    return proc.returncode, out, time.time()


def last_logged_step(workdir: str) -> int:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return max(json.loads(line)["step"] for line in f if line.strip())


def test_a_deadlocked_data_loader_ends_the_run_naming_the_last_step(tmp_path):
    workdir = str(tmp_path / "run")
    code, out, ended = run_worker(workdir, "hang:5")  # the collate of update 6 never returns
    with open(os.path.join(workdir, "hung_at")) as f:
        hung_at = float(f.read())
    assert code == 124, out[-3000:]
    assert "fit ended" not in out
    step = last_logged_step(workdir)  # update 5 ran, but its metrics are read after update 6
    assert step == 4
    message = (rf"No train step finished for {TIMEOUT_S} s on process 0 of 1 \(last finished "
               rf"step {step}\)\. Stuck: this process\. Exiting with status 124")
    assert re.search(message, out), out[-3000:]
    with open(os.path.join(workdir, "log.txt")) as f:
        assert re.search(message, f.read())
    assert ended - hung_at < 2 * TIMEOUT_S, f"exited {ended - hung_at:.1f} s after the hang"
    print(f"exited {ended - hung_at:.2f} s after the hang (timeout {TIMEOUT_S} s)")


def test_a_slow_compile_checkpoint_evaluation_and_paused_callback_are_not_a_hang(tmp_path):
    """Each takes a third longer than the timeout; the watch is paused, or not yet started."""
    workdir = str(tmp_path / "run")
    code, out, _ = run_worker(workdir, f"slow:{TIMEOUT_S * 4 / 3}")
    assert code == 0 and "fit ended" in out, out[-3000:]
    assert "No train step finished" not in out
    assert sorted(os.listdir(os.path.join(workdir, "ckpts"))) == ["step_8"]
    assert last_logged_step(workdir) == 8


@pytest.mark.parametrize("value", [-1, "5", True, [1]])
def test_a_bad_hang_timeout_is_refused_naming_it(value, tmp_path):
    with pytest.raises(ValueError, match=rf"hang_timeout_s={re.escape(repr(value))}: use a number"):
        Deployer(jax_seed=0, workdir=str(tmp_path), verbose=False, hang_timeout_s=value)


@pytest.mark.parametrize("value", ["-3", "soon"])
def test_a_bad_REDCO_HANG_TIMEOUT_is_refused_naming_it(value, tmp_path, monkeypatch):
    monkeypatch.setenv("REDCO_HANG_TIMEOUT", value)
    with pytest.raises(ValueError, match="REDCO_HANG_TIMEOUT="):
        Deployer(jax_seed=0, workdir=str(tmp_path), verbose=False)


@pytest.mark.parametrize("env, arg, expected", [
    (None, None, 1800.0), ("60", None, 60.0), ("off", None, None), ("0", None, None),
    ("60", 5, 5.0), (None, 0, None), ("off", 2.5, 2.5)])
def test_the_hang_timeout_comes_from_the_argument_then_the_environment(env, arg, expected,
                                                                       tmp_path, monkeypatch):
    if env is None:
        monkeypatch.delenv("REDCO_HANG_TIMEOUT", raising=False)
    else:
        monkeypatch.setenv("REDCO_HANG_TIMEOUT", env)
    deployer = Deployer(jax_seed=0, workdir=str(tmp_path), verbose=False, hang_timeout_s=arg)
    assert deployer.hang_timeout_s == expected
