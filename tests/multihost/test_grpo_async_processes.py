"""Asynchronous GRPO (``--rollout_devices N --max_off_policy_steps 1``) on 2 processes of 4
devices (``zoo_loop_worker.py``'s ``async_grpo``, on ``test_grpo_processes``' task): each process
gives its last N / 2 devices to the rollout mesh and trains on the others; the rollouts run on
the main thread while the update runs (from a thread of their own they hang in collectives).

* ``--rollout_devices auto`` on 2 processes plans once they joined, among the multiples of 2,
  and picks the N of least estimated round (the rule on one process: ``tests/zoo/
  test_grpo_split.py``).
* It samples the same rollouts and ends at the same params as 1 process with 8 devices and the
  same split (its last N devices sampling).
* Process 1 SIGTERMs itself in round 1 (of 3): both processes save round 1's step, round 2's
  rollout in flight kept in the checkpoint, and exit 143; the rerun (given the planned N as a
  number) has process 0 SIGKILLed in round 3, once round 2's step checkpoint (written in the
  background, round 3's rollout in flight in it) is in place; the next rerun ends with the bits
  of the ``auto`` run never stopped. (A kill at a random moment of an asynchronous run on one
  process: ``tests/zoo/test_grpo_async.py``; a 2-process GRPO run killed during a background
  write: ``test_zoo_loops_processes``.)
"""
import json
import os
import re
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
SIGKILL_AT = 2  # of the run resumed after round 1: round 3's rollouts (after round 2's save)
PICK = r"planned {}: --rollout_devices (\d+), --decode_model_shards 1"


def grpo_async(root, workdir, n_devices: int, rollout: str = "auto") -> list[str]:
    """``test_grpo_processes.grpo`` with ``rollout`` devices (``auto``: planned on 1 GB a
    device, decode layout 1), one round ahead, 6 prompts a round (48 samples: minibatches of
    8 x the trainer's dp), 3 rounds, no reference (the KL term on 2 processes:
    ``test_grpo_processes``), so the two scoring passes are one compiled program."""
    planned = ["--device_memory", "1GB"] if rollout == "auto" else []
    return grpo(root, workdir, n_devices) + [
        "--rollout_devices", rollout, *planned, "--decode_model_shards", "1",
        "--max_off_policy_steps", "1", "--prompts_per_round", "6", "--n_rounds", "3",
        "--beta", "0"]


def on_two(workdir, *options: str, victim: int | None = None) -> tuple[list, str]:
    return run_processes(lambda i, port: [sys.executable, WORKER, "async_grpo", str(i), str(port),
                                          str(workdir), *options], str(workdir), victim=victim,
                         timeout_s=300)


def log(workdir) -> str:
    return (workdir / "log.txt").read_text()


def saved(workdir, process: int) -> list[int]:
    path = workdir / f"saved_{process}.txt"
    return [int(line) for line in open(path)] if path.exists() else []


def updates_a_round(n: int) -> int:
    """Round updates with ``n`` rollout devices: 2 epochs of 48 samples in minibatches of 8
    x dp, dp = (8 - n) / 2 (2 model shards)."""
    return 2 * 48 // (8 * (8 - n) // 2)


@pytest.fixture(scope="module")
def runs(grpo_two_processes):
    """In the task's folder: ``two`` (2 processes, ``auto``, never stopped), then given its
    pick ``n``: ``one`` (1 process, 8 devices) and ``cut`` (2 processes: SIGTERM'd, rerun and
    SIGKILLed, rerun); exit statuses and logs of each run of ``cut`` (the SIGTERM'd one's with
    the checkpoints announced to each process)."""
    root = grpo_two_processes
    out = SimpleNamespace(one=root / "async_one", two=root / "async_two", cut=root / "async_cut")
    out.whole = on_two(out.two, "--rollout_devices", "auto")
    picked = re.search(PICK.format("once the 2 processes joined"), log(out.two))
    assert picked, (out.whole, log(out.two)[:3000])
    out.n = int(picked.group(1))
    one = subprocess.run(grpo_async(root, out.one, 8, str(out.n)), capture_output=True,
                         text=True, env=worker_env(XLA_FLAGS=simulated_devices(8)), timeout=600)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    given = ("--rollout_devices", str(out.n))
    out.stopped = (*on_two(out.cut, *given, "--sigterm", str(SIGTERM_AT)),
                   saved(out.cut, 0), saved(out.cut, 1))
    out.killed = on_two(out.cut, *given, "--sigkill", str(SIGKILL_AT), victim=0)
    out.rerun = on_two(out.cut, *given)
    return out


def candidates(text: str) -> dict[int, float | None]:
    """The planner's table in a log: each N's estimated round in seconds (None: no fit)."""
    rows = {}
    for line in text.splitlines():
        if re.match(r"\s+\d+ ", line) and ("fits" in line or "over" in line or "not" in line):
            words = line.replace("<- pick", "").split()
            rows[int(words[0])] = None if words[-1] == "-" else \
                float(words[-2]) * (1e-3 if words[-1] == "ms" else 1)
    return rows


def test_auto_on_two_processes_picks_the_least_round_and_trains_like_one_process(runs):
    """``auto`` on 2 processes: the candidates 2, 4, 6 (multiples of the processes), the one
    of least estimated round picked, and why; the rollout mesh each process's last N / 2
    devices (one process given N: its last N); the same rewards and completions a round, one
    update behind after round 1, the same TIS ratios and params; the rollouts on the main
    thread while the updates run."""
    codes, logs = runs.whole
    assert codes == [0, 0], logs
    n, text = runs.n, log(runs.two)
    rounds = candidates(text)
    assert sorted(rounds) == [2, 4, 6] and rounds[n] is not None, text[:3000]
    assert rounds[n] == min(r for r in rounds.values() if r is not None), text[:3000]
    assert "of the multiples of the 2 processes: each gives N / 2" in text, text[:3000]
    assert f"processes: 2, mesh: {{'dp': {(8 - n) // 2}, 'mp': 2}}" in text, text[:3000]
    mine = range(4 - n // 2, 4)
    assert f"rollouts on devices {[(p, i) for p in (0, 1) for i in mine]}" in text, text[:3000]
    assert f"rollouts on devices {[(0, i) for i in range(8 - n, 8)]}" in log(runs.one)
    (one, one_params), (two, two_params) = (rollouts_and_params(w) for w in (runs.one, runs.two))
    assert [r["rollout/policy_lag"] for r in two] == [0, 1, 1], two
    assert 0 < one[0]["rollout/reward"] < 1 and len(one) == 3
    for a, b in zip(one, two):
        for key in ("reward", "completion_tokens", "policy_version"):
            assert a[f"rollout/{key}"] == b[f"rollout/{key}"], (key, a, b)
        assert abs(a["rollout/is_ratio_mean"] - b["rollout/is_ratio_mean"]) <= 1e-5, (a, b)
    for name, value in one_params.items():
        np.testing.assert_allclose(two_params[name], value, rtol=1e-4, atol=1e-5, err_msg=name)
    assert_rollouts_ran_on_the_main_thread_during_the_updates(runs.two)


def assert_rollouts_ran_on_the_main_thread_during_the_updates(workdir) -> None:
    """``timeline.jsonl``: every rollout on the main thread (so every process dispatches the
    same programs in the same order); each next round's dispatched before the update and run
    after it was dispatched, before it was waited for."""
    rows = [json.loads(line) for line in open(workdir / "timeline.jsonl")]
    assert [row["round"] for row in rows] == [1, 2, 3], rows
    assert {row["rollout_thread"] for row in rows} == {"MainThread"}, rows
    for before, after in zip(rows, rows[1:]):
        assert after["rollout_dispatch"] <= before["update_dispatch"] <= after["rollout_start"]
        assert after["rollout_ready"] <= before["update_ready"], (before, after)


def test_async_grpo_on_two_processes_stopped_by_sigterm_then_killed_reruns_to_the_same_bits(
        runs):
    """SIGTERM to process 1 in round 1: both save round 1's step and exit 143; the rerun
    resumes there (round 2's rollout from the checkpoint) and is SIGKILLed in round 3 once
    round 2's background checkpoint is in place; the next rerun resumes from that (round 3's
    rollout from it) and ends with the step checkpoint, rollout metrics and model of the
    ``auto`` run never stopped, bit for bit."""
    from safetensors.numpy import load_file
    per_round = updates_a_round(runs.n)
    codes, logs, saved_0, saved_1 = runs.stopped
    assert codes == [143, 143], logs
    assert saved_0 == saved_1 == [per_round], logs
    assert f"Stopped by SIGTERM after step {per_round}:" in log(runs.cut), log(runs.cut)[-2000:]
    codes, logs = runs.killed
    assert codes == [-9, -9] and f"SIGKILL at point {SIGKILL_AT}" in logs, logs
    codes, logs = runs.rerun
    assert codes == [0, 0], logs
    resumed = re.findall(r"Resumed from .*step_(\d+) \(step", log(runs.cut))
    assert resumed == [str(per_round), str(2 * per_round)], log(runs.cut)[-3000:]
    assert_same_arrays(newest_step_arrays(str(runs.cut)), newest_step_arrays(str(runs.two)))
    timings = ("rollout/seconds", "rollout/update_seconds", "rollout/tokens_per_s")
    rows = [[{k: v for k, v in row.items() if k not in timings} for row in
             rollouts_and_params(w)[0]] for w in (runs.cut, runs.two)]
    assert rows[0] == rows[1] and len(rows[0]) == 3
    assert_same_arrays(*(load_file(w / "model" / "model.safetensors") for w in (runs.cut, runs.two)))


def test_a_split_that_process_0_cannot_plan_is_refused_by_every_process(grpo_two_processes):
    """``auto`` on devices of 1 KB: process 0's planner finds no split and says why; process 1,
    waiting for its pick, refuses too, naming process 0's log (before, it waited an hour at
    the coordination service)."""
    workdir = grpo_two_processes / "async_no_split"
    codes, logs = on_two(workdir, "--rollout_devices", "auto", "--device_memory", "1KB")
    assert "hung" not in codes and 0 not in codes, logs
    assert "--rollout_devices auto: process 0 found no split (its log says why)" in logs, logs


def test_processes_split_their_devices_alike_and_bad_counts_are_refused(monkeypatch):
    """With 2 processes of 4 devices, ``--rollout_devices 4`` takes each process's last 2 and
    the trainer the first 2 of each; a count that is no multiple of the processes, or leaves a
    process nothing to train on, is refused naming the range; a trainer over every device too.
    ``auto``'s candidates: the counts a number may give."""
    from redco.deployer import mesh_devices
    from redco.protocols import UsageError
    from redco_zoo_grpo.async_rollouts import rollout_devices
    from redco_zoo_grpo.rollout_split import split_counts
    assert split_counts(8, 2) == [2, 4, 6] and split_counts(8) == [1, 2, 3, 4, 5, 6, 7]
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
