"""Asynchronous GRPO (``--rollout_devices 2 --max_off_policy_steps 1``) on 2 processes of 4
devices (``zoo_loop_worker.py``'s ``async_grpo``, on ``test_grpo_processes``' task): each process
gives its last device to the rollout mesh and trains on its other 3; the rollouts run on the main
thread while the update runs (from a thread of their own they hang in collectives).

* It samples the same rollouts and ends at the same params as 1 process with 8 devices and the
  same split (its last 2 devices sampling).
* Process 1 SIGTERMs itself in round 1 (of 2): both processes save step 4, round 2's rollout
  in flight kept in the checkpoint, and exit 143; the rerun ends with the bits of the run never
  stopped. (A kill at a random moment of an asynchronous run and its rerun on one process:
  ``tests/zoo/test_grpo_async.py``; a 2-process GRPO run killed: ``test_zoo_loops_processes``.)
"""
import json
import os
import subprocess
import sys
from collections import namedtuple
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from multihost_helpers import run_processes, simulated_devices, worker_env
from test_grpo_processes import grpo, rollouts_and_params

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kill_anywhere import assert_same_arrays, newest_step_arrays  # noqa: E402, I001

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zoo_loop_worker.py")
SIGTERM_AT = 2  # the reward function's 2nd call: round 1's rollouts


def grpo_async(root, workdir, n_devices: int) -> list[str]:
    """``test_grpo_processes.grpo`` with 2 rollout devices, one round ahead: the trainer's 6
    devices split dp 3 x mp 2, so 6 prompts a round (48 samples, 2 minibatches of 24); 2 rounds,
    no reference (the KL term on 2 processes: ``test_grpo_processes``), so the two scoring
    passes are one compiled program."""
    return grpo(root, workdir, n_devices) + ["--rollout_devices", "2", "--max_off_policy_steps",
                                             "1", "--prompts_per_round", "6", "--n_rounds", "2",
                                             "--beta", "0"]


def on_two(workdir, *options: str) -> tuple[list, str]:
    return run_processes(lambda i, port: [sys.executable, WORKER, "async_grpo", str(i), str(port),
                                          str(workdir), *options], str(workdir), timeout_s=300)


def log(workdir) -> str:
    return (workdir / "log.txt").read_text()


def saved(workdir, process: int) -> list[int]:
    path = workdir / f"saved_{process}.txt"
    return [int(line) for line in open(path)] if path.exists() else []


@pytest.fixture(scope="module")
def runs(grpo_two_processes):
    """In the task's folder: ``one`` (1 process, 8 devices), ``two`` (2 processes, never
    stopped), ``cut`` (2 processes: SIGTERM'd, then rerun); the exit statuses and logs of the
    last two's runs (the SIGTERM'd one's with the checkpoints announced to each process)."""
    root = grpo_two_processes
    one = subprocess.run(grpo_async(root, root / "async_one", 8), capture_output=True, text=True,
                         env=worker_env(XLA_FLAGS=simulated_devices(8)), timeout=600)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    out = SimpleNamespace(one=root / "async_one", two=root / "async_two", cut=root / "async_cut")
    out.whole = on_two(out.two)
    out.stopped = (*on_two(out.cut, "--sigterm", str(SIGTERM_AT)),
                   saved(out.cut, 0), saved(out.cut, 1))
    out.rerun = on_two(out.cut)
    return out


def test_async_grpo_on_two_processes_samples_and_trains_like_one(runs):
    """The rollout mesh: process 0's and 1's last device (one process: its last 2); the same
    rewards and completions a round, one update behind in round 2, the same TIS ratios and params;
    the rollouts on the main thread while the updates run (``timeline.jsonl``)."""
    codes, logs = runs.whole
    assert codes == [0, 0], logs
    assert "processes: 2, mesh: {'dp': 3, 'mp': 2}" in log(runs.two), log(runs.two)[:2000]
    assert "rollouts on devices [(0, 3), (1, 3)]" in log(runs.two), log(runs.two)[:2000]
    assert "rollouts on devices [(0, 6), (0, 7)]" in log(runs.one), log(runs.one)[:2000]
    (one, one_params), (two, two_params) = (rollouts_and_params(w) for w in (runs.one, runs.two))
    assert [r["rollout/policy_lag"] for r in two] == [0, 1], two
    assert 0 < one[0]["rollout/reward"] < 1 and len(one) == 2
    for a, b in zip(one, two):
        for key in ("reward", "completion_tokens", "policy_version"):
            assert a[f"rollout/{key}"] == b[f"rollout/{key}"], (key, a, b)
        assert abs(a["rollout/is_ratio_mean"] - b["rollout/is_ratio_mean"]) <= 1e-5, (a, b)
    for name, value in one_params.items():
        np.testing.assert_allclose(two_params[name], value, rtol=1e-4, atol=1e-5, err_msg=name)
    assert_rollouts_ran_on_the_main_thread_during_the_updates(runs.two)


def assert_rollouts_ran_on_the_main_thread_during_the_updates(workdir) -> None:
    """``timeline.jsonl``: every rollout on the main thread (so every process dispatches the
    same programs in the same order); round 2's dispatched before round 1's update and run
    after it was dispatched, before it was waited for."""
    rows = [json.loads(line) for line in open(workdir / "timeline.jsonl")]
    assert [row["round"] for row in rows] == [1, 2], rows
    assert {row["rollout_thread"] for row in rows} == {"MainThread"}, rows
    for before, after in zip(rows, rows[1:]):
        assert after["rollout_dispatch"] <= before["update_dispatch"] <= after["rollout_start"]
        assert after["rollout_ready"] <= before["update_ready"], (before, after)


def test_async_grpo_on_two_processes_stopped_by_sigterm_reruns_to_the_same_bits(runs):
    """SIGTERM to process 1 in round 1: both save step 4 and exit 143; the rerun resumes there
    (round 2's rollout from the checkpoint) and ends with the step checkpoint, rollout metrics
    and model of the run never stopped, bit for bit."""
    from safetensors.numpy import load_file
    codes, logs, saved_0, saved_1 = runs.stopped
    assert codes == [143, 143], logs
    assert saved_0 == saved_1 == [4], logs
    assert "Stopped by SIGTERM after step 4:" in log(runs.cut), log(runs.cut)[-2000:]
    codes, logs = runs.rerun
    assert codes == [0, 0], logs
    assert log(runs.cut).count("Resumed from") == 1 and "step_4 (step 4)" in log(runs.cut)
    assert_same_arrays(newest_step_arrays(str(runs.cut)), newest_step_arrays(str(runs.two)))
    timings = ("rollout/seconds", "rollout/update_seconds", "rollout/tokens_per_s")
    rows = [[{k: v for k, v in row.items() if k not in timings} for row in
             rollouts_and_params(w)[0]] for w in (runs.cut, runs.two)]
    assert rows[0] == rows[1] and len(rows[0]) == 2
    assert_same_arrays(*(load_file(w / "model" / "model.safetensors") for w in (runs.cut, runs.two)))


def test_processes_split_their_devices_alike_and_bad_counts_are_refused(monkeypatch):
    """With 2 processes of 4 devices, ``--rollout_devices 4`` takes each process's last 2 and
    the trainer the first 2 of each; a count that is no multiple of the processes, or leaves a
    process nothing to train on, is refused naming the range; a trainer over every device too."""
    from redco.deployer import mesh_devices
    from redco.protocols import UsageError
    from redco_zoo_grpo.async_rollouts import rollout_devices
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    device = namedtuple("Device", "process_index name")
    devices = [device(p, f"{p}.{i}") for p in (0, 1) for i in range(4)]
    train, rollout = rollout_devices(4, devices=devices)
    assert [d.name for d in train] == ["0.0", "0.1", "1.0", "1.1"]
    assert [d.name for d in rollout] == ["0.2", "0.3", "1.2", "1.3"]
    for n in (3, 8):
        with pytest.raises(UsageError, match=f"--rollout_devices {n}: of the 8 devices, give 2 "
                           "to 6 \\(a multiple of the 2 processes"):
            rollout_devices(n, devices=devices)
    with pytest.raises(UsageError, match="make it with devices=training_devices\\(2\\)"):
        rollout_devices(2, devices, devices=devices)
    with pytest.raises(ValueError, match=r"picked \[3, 2\] devices"):
        mesh_devices(devices[1:6])


def test_auto_split_with_several_processes_is_refused_before_anything_loads(clean_env, capsys):
    """``--rollout_devices auto`` plans on one process's devices: under a launcher of several
    processes (``REDCO_N_PROCESSES=2``) it is refused naming the fix, before any device is asked
    for (that would keep the processes from joining) or anything loads."""
    from redco.cli import main
    clean_env.setenv("REDCO_N_PROCESSES", "2")
    with pytest.raises(SystemExit) as stop:
        main(["zoo", "run", "grpo", "--model", "missing", "--train", "missing.jsonl",
              "--rollout_devices", "auto", "--max_off_policy_steps", "1"])
    assert stop.value.code == 2
    assert "with several processes give a number" in capsys.readouterr().err
