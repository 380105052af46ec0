"""A loop of rounds of its own (``trainer.run``) on 2 processes (``loop_worker.py``): decisions
every process agrees on. Saves by time are decided by process 0 and broadcast, so processes whose
host work between updates differs (0.1 s against 0.45 s a round) save at the same steps and both
end (before: each read its own clock, one saved, and both waited for each other until killed). A
SIGTERM to one process inside a round (between two of its updates) stops both at the end of the
same round (that round's, or the next where the other process already ended it: the boundary after
the furthest either reached; a round of 2 updates is one boundary of JAX's preemption service,
whose sync point is matched exactly), and the rerun ends with the params of the uninterrupted run,
bit for bit."""
import os
import sys

import numpy as np
import pytest
from multihost_helpers import run_processes

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "loop_worker.py")
DEADLINE_S = 240  # a hang ends here (the workers' own hang timeout is 60 s)


def run_both(workdir, *options) -> tuple[list[int], str]:
    """Both processes to their ends: their exit statuses and logs."""
    return run_processes(lambda i, port: [sys.executable, WORKER, str(i), str(port), workdir,
                                          *options], workdir, timeout_s=DEADLINE_S)


def saved_steps(workdir, process: int) -> list[int]:
    path = os.path.join(workdir, f"saved_{process}.txt")
    return [int(line) for line in open(path)] if os.path.exists(path) else []


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> str:
    """The uninterrupted run, process 1's host work 0.45 s a round against process 0's 0.1 s,
    saving every 0.6 s."""
    workdir = str(tmp_path_factory.mktemp("whole"))
    codes, logs = run_both(workdir, "--host_work", "0.1,0.45", "--save_every_minutes", "0.01")
    assert codes == [0, 0], logs
    return workdir


def test_unequal_host_work_saves_by_time_at_the_same_steps(whole):
    saves = saved_steps(whole, 0)
    assert saves == saved_steps(whole, 1)
    assert len(saves) >= 3 and saves[-1] == 12, saves  # by time (0.6 s) before the end's
    assert all(step % 2 == 0 for step in saves), saves  # at rounds' ends only


@pytest.mark.slow
def test_a_sigterm_inside_a_round_stops_both_at_a_round_end_and_resumes(whole, tmp_path):
    """Slow tier (``REDCO_SLOW_TESTS=1``): in CI, ``test_zoo_loops_processes``' FedAvg case (a
    loop of ``trainer.run`` too) is SIGTERMed on process 1 inside a round, stops both at the
    same round end and reruns to the bits of its uninterrupted run."""
    cut = str(tmp_path / "cut")
    codes, logs = run_both(cut, "--sigterm_at", "7")  # update 7: the first of round 4
    assert codes == [143, 143], logs
    stopped = saved_steps(cut, 0)  # a round's end both reached: round 4's, or 5's where process 0
    assert stopped == saved_steps(cut, 1) and stopped[0] in (8, 10), logs  # was through round 4
    assert f"Stopped by SIGTERM after step {stopped[0]}:" in open(os.path.join(cut, "log.txt")).read()
    codes, logs = run_both(cut)
    assert codes == [0, 0], logs
    assert saved_steps(cut, 0) == [stopped[0], 12], logs
    final, expected = np.load(os.path.join(cut, "final.npz")), np.load(os.path.join(whole, "final.npz"))
    assert sorted(final) == sorted(expected)
    for name in final:
        np.testing.assert_array_equal(final[name], expected[name], err_msg=name)
