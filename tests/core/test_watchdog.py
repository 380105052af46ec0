"""A run that stops making progress ends by itself (exit status 124) within twice its hang
timeout, naming its last finished step; a slow first compile, slow checkpoints and a slow
evaluation do not count as a hang; ``Trainer(hang_timeout_s=)`` overrides the deployer's. Real
processes (``hang_worker.py``), no mocks. The multi-process case (a SIGSTOPped process named by
the other) is in tests/multihost."""
import json
import os
import re
import subprocess
import sys
import time

import optax
import pytest
from helpers import mlp_apply, mlp_collate, mlp_init, mlp_loss

from redco import Deployer, Trainer

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hang_worker.py")
TIMEOUT_S = 3


def run_worker(workdir: str, mode: str, timeout_s: float = TIMEOUT_S, on_trainer: bool = False):
    """The worker, run to its end: (exit status, output, wall time when it ended). The timeout
    from ``REDCO_HANG_TIMEOUT``, or ``on_trainer``: from ``Trainer(hang_timeout_s=)`` over a
    deployer (and environment) that say off."""
    os.makedirs(workdir)
    env = dict(os.environ, REDCO_HANG_TIMEOUT="off" if on_trainer else str(timeout_s),
               HF_HUB_OFFLINE="1")
    args = [str(timeout_s)] if on_trainer else []
    proc = subprocess.Popen([sys.executable, WORKER, workdir, mode, *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out = proc.communicate(timeout=300)[0]
    finally:
        proc.kill()
    return proc.returncode, out, time.time()


def last_logged_step(workdir: str) -> int:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return max(json.loads(line)["step"] for line in f if line.strip())


@pytest.mark.parametrize("on_trainer", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["deployer", "trainer-over-off"])
def test_a_deadlocked_data_loader_ends_the_run_naming_the_last_step(tmp_path, on_trainer):
    """The timeout from the environment (as the Deployer reads it), or from
    ``Trainer(hang_timeout_s=)`` over ``Deployer(hang_timeout_s=0)``: the same end. (The
    latter is slow: in CI the stuck checkpoint write below runs on the Trainer's timeout.)"""
    workdir = str(tmp_path / "run")
    code, out, ended = run_worker(workdir, "hang:5", on_trainer=on_trainer)  # update 6's collate
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


def test_a_checkpoint_write_that_never_ends_is_a_hang_named_as_such(tmp_path):
    """A pause for a save is bounded by the timeout: a write of step_3 that never returns ends the
    run (124) within twice the timeout, naming what it waited for. The timeout is the
    Trainer's, over a deployer and an environment that say off."""
    workdir = str(tmp_path / "run")
    code, out, ended = run_worker(workdir, "stuck-save:3", on_trainer=True)
    with open(os.path.join(workdir, "hung_at")) as f:
        hung_at = float(f.read())
    assert code == 124, out[-3000:]
    assert "fit ended" not in out
    assert re.search(rf"Process 0 of 1 has waited {TIMEOUT_S} s (saving step checkpoint step_6|"
                     r"waiting for a step checkpoint's background write) \(last finished step "
                     r"\d\): treated as a hang\. Exiting with status 124", out), out[-3000:]
    assert ended - hung_at < 2 * TIMEOUT_S + 1, f"exited {ended - hung_at:.1f} s after the hang"


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


def a_trainer(deployer, **options):
    return Trainer(deployer, mlp_collate, mlp_apply, mlp_loss, mlp_init(), optax.adam(1e-3),
                   **options)


@pytest.mark.parametrize("value", [-1, "5", True, [1]])
def test_a_bad_hang_timeout_on_a_trainer_is_refused_at_construction_naming_it(value, tmp_path):
    deployer = Deployer(jax_seed=0, workdir=str(tmp_path), verbose=False)
    with pytest.raises(ValueError, match=rf"hang_timeout_s={re.escape(repr(value))}: use a number"):
        a_trainer(deployer, hang_timeout_s=value)


@pytest.mark.parametrize("value", [1, "no", 0.0])
def test_a_bad_async_checkpoints_on_a_trainer_is_refused_at_construction_naming_it(value,
                                                                                   tmp_path):
    deployer = Deployer(jax_seed=0, workdir=str(tmp_path), verbose=False)
    with pytest.raises(TypeError, match=rf"async_checkpoints={re.escape(repr(value))}: use True"):
        a_trainer(deployer, async_checkpoints=value)


def test_a_trainers_loop_settings_override_its_deployers_which_stay_the_default(tmp_path):
    deployer = Deployer(jax_seed=0, workdir=str(tmp_path), verbose=False, hang_timeout_s=0,
                        async_checkpoints=False)
    inherits = a_trainer(deployer)
    assert (inherits.hang_timeout_s, inherits.async_checkpoints) == (None, False)
    overrides = a_trainer(deployer, hang_timeout_s=2.5, async_checkpoints=True)
    assert (overrides.hang_timeout_s, overrides.async_checkpoints) == (2.5, True)
    deployer = Deployer(jax_seed=0, workdir=str(tmp_path), verbose=False, hang_timeout_s=60)
    assert a_trainer(deployer, hang_timeout_s=0).hang_timeout_s is None  # 0: off, here too


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
