"""A preemption notice (SIGTERM) stops training cleanly: the step under way finishes, a step
checkpoint of it is written, the process exits with status 143 saying where it saved, and the
same command run again resumes there. Sent in the middle of an epoch, and twice while a
checkpoint is being written (the second must not cut the save), the runs end with params
bitwise equal to an uninterrupted run's, and no half-written checkpoint is ever the newest."""
import os
import re

from ckpt_helpers import assert_same_run, ckpt_names, latest, run, starts


def stopped_after(out: str, workdir: str, signal_name: str = "SIGTERM") -> int:
    with open(os.path.join(workdir, "log.txt")) as f:  # every run appends to it: the last line
        found = re.findall(rf"Stopped by {signal_name} after step (\d+): saved (\S+); run the same "
                           r"command again to resume\.", f.read())
    assert found, out[-3000:]
    step = int(found[-1][0])
    assert found[-1][1] == os.path.join(workdir, "ckpts", f"step_{step}")
    assert latest(workdir) == f"step_{step}" and not any(n.endswith(".tmp") for n in ckpt_names(workdir))
    return step


def test_sigterm_mid_epoch_and_during_a_save_stop_cleanly_and_resume_to_the_same_bits(
        tmp_path, uninterrupted):
    """Two notices while step_9 is written, mid-epoch 3: the save completes, the update under
    way (10) is the last, and its checkpoint is written too; the same command once more ends
    bitwise as the uninterrupted run. (A notice between updates stops after the update under
    way, and resumes to the same bits: the ``term-held`` run below, 1 process; the Ctrl-C test's
    ``int:2`` stops the same way mid-epoch.)"""
    # 4 updates an epoch, 3 epochs, a checkpoint every 3 updates and at each epoch's end.
    preempted = str(tmp_path / "preempted")
    out = run(preempted, "term-save:9")
    assert "sent two SIGTERMs while writing" in out
    assert "step_9" in ckpt_names(preempted)
    stopped = stopped_after(out, preempted)
    assert stopped == 10

    run(preempted)
    assert starts(preempted) == [0, stopped]
    assert_same_run(preempted, uninterrupted.workdir(), killed_ckpts=("step_10", "step_12"))  # the newest 2


def test_ctrl_c_once_saves_and_stops_twice_stops_at_once(tmp_path):
    workdir = str(tmp_path / "run")
    assert stopped_after(run(workdir, "int:2"), workdir, "SIGINT") == 3  # status 130
    out = run(workdir, "int2:5")  # resumed at 3; dies at once of SIGINT, nothing saved past
    assert "KeyboardInterrupt" in out and latest(workdir) == "step_4", out[-3000:]  # epoch end
    assert starts(workdir) == [0, 3]


def test_a_kill_or_a_sigterm_while_a_background_write_is_in_flight(tmp_path, uninterrupted):
    """Step checkpoints are written in the background: training goes on while ``step_6`` is
    written (the worker holds that write until it is killed at update 7); the kill leaves a
    ``.tmp`` without meta.json, which resume ignores. A SIGTERM with a write in flight waits
    for it (held until the trainer waits: a stop that did not wait would start ``step_8``'s
    write with ``step_6`` unfinished), then saves the step it stopped after. Rerun until done,
    the run ends as one never interrupted."""
    killed = str(tmp_path / "killed")
    out = run(killed, "held:6")
    assert "holding the write of" in out, out[-2000:]
    assert "SIGKILL at the end of step 7, the write of step_6 in flight" in out, out[-2000:]
    assert ckpt_names(killed) == ["step_3", "step_4", "step_6.tmp"]
    assert os.listdir(os.path.join(killed, "ckpts", "step_6.tmp")) == ["state"]  # no meta.json

    # resumed from step_4; step_6 held until the notice, which lands as update 7 is reported:
    # the stop waits for step_6, then saves the update under way, 8 (the newest 2 kept)
    out = run(killed, "term-held:6")
    assert "holding the write of" in out
    assert "still being written" not in out, out[-2000:]  # step_6 was complete before step_8
    assert stopped_after(out, killed) == 8
    assert ckpt_names(killed) == ["step_6", "step_8"]

    run(killed)
    assert starts(killed) == [0, 4, 8]
    assert_same_run(killed, uninterrupted.workdir())
