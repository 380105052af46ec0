"""The zoo's own loops (FedAvg's rounds, MAML's meta-updates in ``fit``, PPO's iterations) on 2
processes on 127.0.0.1 (``zoo_loop_worker.py``), each stopped and killed inside a unit of its
loop and rerun: the rerun ends with the bits of an uninterrupted 2-process run (the step
checkpoint: params, optimizer state, step; and what the loop returned), after as many updates.

1. A SIGTERM to process 1 only, inside a unit: FedAvg inside a client's local epoch, MAML inside
   the inner adaptation of a meta-update (a host callback of the compiled step), PPO during an
   iteration's rollout. JAX's preemption service passes it on to process 0 and both stop at the
   same boundary (the next one either reaches: FedAvg's round end, PPO's iteration end, MAML's
   update), both save there (each is told of the same checkpoint) and exit 143.
2. The rerun resumes there; process 0 (the coordinator, which renames checkpoints into place) is
   SIGKILLed inside the unit after the next boundary that saves, the write of that checkpoint
   started in the background, and process 1 is killed as a job scheduler would.
3. The next rerun resumes from the newest complete checkpoint and ends.

The uninterrupted runs of the loops are made once, one after the other in the same 2 processes,
and so are their last reruns (3.), once each was stopped (1.) and killed (2.). In CI only FedAvg
runs (``trainer.run``'s rounds, the loop PPO's iterations use too); MAML and PPO join it with
``REDCO_SLOW_TESTS=1`` (``conftest.py``): their stops on one process are guarded by
``tests/zoo_maml`` and ``tests/zoo_ppo``, the stop of ``trainer.fit`` (MAML's loop) on 2 processes
by ``test_multiprocess``' SIGTERM test, and FedAvg's case is the same kinds of points on 2 processes.
GRPO (``redco zoo run grpo``) is killed during a background checkpoint write instead: process 0
holds its write (``bg_ckpt_worker.py``'s held write) and dies in the next round (slow tier too:
a kill of a held write on 2 processes is ``test_background_checkpoints``', process 1's in CI,
the coordinator's, as here, in its slow case; a coordinator killed with a write in flight on 2
processes is FedAvg's kill here; GRPO's
rerun after a kill on one process is ``tests/zoo/test_grpo.py``'s, and GRPO on 2 processes is
``test_grpo_processes``').
"""
import json
import os
import sys

import pytest
from multihost_helpers import run_processes

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kill_anywhere import assert_same_arrays, newest_step_arrays  # noqa: E402, I001

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zoo_loop_worker.py")


def run(loop: str, workdir: str, *options: str, victim: int | None = None) -> tuple[list, str]:
    return run_processes(lambda i, port: [sys.executable, WORKER, loop, str(i), str(port),
                                          workdir, *options], workdir, victim=victim, timeout_s=400)


def run_loops(root: str) -> tuple[list, str]:
    """``LOOPS`` one after the other in the same 2 processes, each in ``root/<loop>``."""
    return run(",".join(LOOPS), root if len(LOOPS) > 1 else os.path.join(root, LOOPS[0]))


def saved(workdir: str, process: int) -> list[int]:
    """The steps of the checkpoints announced to ``process``, over all runs in ``workdir``."""
    path = os.path.join(workdir, f"saved_{process}.txt")
    return [int(line) for line in open(path)] if os.path.exists(path) else []


def result(workdir: str) -> list:
    """What the loop returned, the same on both processes."""
    results = [json.load(open(os.path.join(workdir, f"result_{i}.json"))) for i in range(2)]
    assert results[0] == results[1], results
    return results[0]


def log(workdir: str) -> str:
    return open(os.path.join(workdir, "log.txt")).read()


# The SIGTERM's point: FedAvg's 3rd update (in round 1's first client's epoch), MAML's 3rd
# meta-update's inner adaptation, PPO's 2nd iteration's rollout; the updates a point stands for.
SIGTERM_AT = {"fedavg": 3, "maml": 3, "ppo": 2}
PER_POINT = {"fedavg": 1, "maml": 1, "ppo": 16}
# The loops run (the rest: slow tier only; see the module's docstring).
LOOPS = sorted(SIGTERM_AT) if os.environ.get("REDCO_SLOW_TESTS") == "1" else ["fedavg"]


def stops(loop: str, whole: str) -> set[int]:
    """The steps a run stops after, SIGTERM'd at ``SIGTERM_AT[loop]``: the next boundary either
    process reaches. FedAvg: the end of the round it fell in (the updates of a round run in step
    on both processes); PPO: its iteration's end; MAML: a meta-update is a boundary, and each
    process has dispatched update N before (N - 1) or after (N) its boundary N - 1 or N, or
    has read back N and dispatched N + 1: the one after the furthest, N to N + 2."""
    n = SIGTERM_AT[loop]
    if loop == "fedavg":
        return {min(step for step in rounds(whole) if step >= n)}
    return {16 * n} if loop == "ppo" else {n, n + 1, n + 2}


def rounds(workdir: str) -> list[int]:
    return [int(line) for line in open(os.path.join(workdir, "rounds_0.txt"))]


@pytest.fixture(scope="module")
def wholes(tmp_path_factory) -> str:
    """The uninterrupted runs of ``LOOPS``, one after the other in the same 2 processes (the
    boundaries counted on across them), each in ``<returned>/<loop>``."""
    workdir = str(tmp_path_factory.mktemp("wholes"))
    codes, logs = run_loops(workdir)
    assert codes == [0, 0], logs
    return workdir


@pytest.fixture(scope="module")
def cuts(wholes, tmp_path_factory) -> tuple[str, dict]:
    """Each of ``LOOPS`` stopped by SIGTERM (1.) and killed (2.) in ``<returned>/<loop>``, then
    their reruns (3.), one after the other in the same 2 processes. Returns that folder and, a
    loop, its runs: 1.'s exit statuses, logs and the checkpoints announced to each process; 2.'s
    point, exit statuses and logs; and the reruns' (``"reruns"``)."""
    root, runs = str(tmp_path_factory.mktemp("cuts")), {}
    for loop in LOOPS:
        cut = os.path.join(root, loop)
        codes, logs = run(loop, cut, "--sigterm", str(SIGTERM_AT[loop]))
        runs[loop] = {"stopped": (codes, logs, saved(cut, 0), saved(cut, 1))}
        stop = (saved(cut, 0) or [0])[-1]
        # The first point after the next boundary that saves: its write runs meanwhile.
        later = [step for step in saved(os.path.join(wholes, loop), 0) if step > stop] or [stop]
        kill = (min(later) - stop) // PER_POINT[loop] + 1
        runs[loop]["killed"] = (kill, *run(loop, cut, "--sigkill", str(kill), victim=0))
    runs["reruns"] = run_loops(root)
    return root, runs


@pytest.mark.parametrize("loop", [pytest.param(loop, marks=[pytest.mark.slow] * (loop not in LOOPS))
                                  for loop in sorted(SIGTERM_AT)])
def test_a_zoo_loop_on_two_processes_stopped_and_killed_inside_a_unit_reruns_to_the_same_bits(
        loop, wholes, cuts):
    whole, cut = os.path.join(wholes, loop), os.path.join(cuts[0], loop)
    saves = saved(whole, 0)
    assert saves == saved(whole, 1) and len(saves) >= 3, (saves, saved(whole, 1))

    codes, logs, saved_0, saved_1 = cuts[1][loop]["stopped"]
    assert codes == [143, 143], logs  # process 0 too, told by JAX's preemption service
    assert saved_0 == saved_1, logs  # the same checkpoints, the stop's last
    stop = saved_0[-1]
    assert stop in stops(loop, whole) and f"Stopped by SIGTERM after step {stop}:" in log(cut), \
        (stop, stops(loop, whole), logs)

    kill, codes, logs = cuts[1][loop]["killed"]
    assert kill == (min(step for step in saves if step > stop) - stop) // PER_POINT[loop] + 1
    assert codes[0] == -9 and f"SIGKILL at point {kill}" in logs, logs

    codes, logs = cuts[1]["reruns"]
    assert codes == [0, 0], logs
    # (its own resumes: a log.txt also gets the lines of the loops run after it in a process)
    assert log(cut).count(f"Resumed from {cut}/") == 2, log(cut)
    assert_same_arrays(newest_step_arrays(cut), newest_step_arrays(whole))  # step included
    assert result(cut) == result(whole)
    if loop == "fedavg":
        assert rounds(cut)[-1] == rounds(whole)[-1]


def rollouts(workdir: str) -> list[tuple]:
    """Each round's rollout metrics in ``metrics.jsonl`` at their steps (a killed run's rows
    past the checkpoint resumed from are forgotten)."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [(row["step"], row["rollout/reward"], row["rollout/kl"])
                for row in map(json.loads, f) if "rollout/reward" in row]


@pytest.mark.slow  # REDCO_SLOW_TESTS=1: in CI, test_background_checkpoints (see the module's docstring)
def test_grpo_on_two_processes_killed_during_a_background_write_reruns_to_the_same_bits(
        grpo_two_processes):
    """GRPO (3 rounds of 4 updates, a checkpoint each round, written in the background): process
    0 holds its write of step_8 (its part written) and is SIGKILLed at the end of update 9
    (round 3's first), process 1's writer waiting at that save's barrier; step_8 is never put in
    place, the rerun resumes from step_4 and ends with the bits of the same run uninterrupted
    (``test_grpo_processes``', under ``redco launch``)."""
    from safetensors.numpy import load_file
    whole, cut = str(grpo_two_processes / "two"), str(grpo_two_processes / "cut")
    codes, logs = run("grpo", cut, "--held", "8", victim=0)
    assert codes[0] == -9, logs
    assert "SIGKILL at the end of step 9, the write of step_8 held in flight" in logs, logs
    assert sorted(os.listdir(os.path.join(cut, "ckpts"))) in (["step_4"], ["step_4", "step_8.tmp"])

    codes, logs = run("grpo", cut)
    assert codes == [0, 0], logs
    assert log(cut).count("Resumed from") == 1 and "step_4 (step 4)" in log(cut), log(cut)
    assert_same_arrays(newest_step_arrays(cut), newest_step_arrays(whole))
    assert rollouts(cut) == rollouts(whole) and len(rollouts(whole)) == 3
    assert saved(cut, 0) == saved(cut, 1) == [4, 8, 12]  # (killed run: step_4 only)
    want, got = (load_file(os.path.join(w, "model", "model.safetensors")) for w in (whole, cut))
    assert_same_arrays(got, want)
