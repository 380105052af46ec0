"""The kill test: a training process SIGKILLed at several points (mid-epoch, in the middle of a
checkpoint write, right after a checkpoint, ...) and rerun with the same command each time ends
with params bitwise equal to those of an uninterrupted run. Orbax, the built-in format, here;
tests/formats/test_format_kill_resume.py kills every format mid-write."""
import os

from ckpt_helpers import assert_same_run, ckpt_names, finish, latest, run, start, starts


def test_sigkilled_training_rerun_until_done_matches_an_uninterrupted_run(tmp_path):
    # 4 updates an epoch, 3 epochs; checkpoints at steps 3, 4 (epoch end), 6, 8 (epoch end),
    # 9 and 12 (epoch end), the last two kept.
    full, killed = str(tmp_path / "full"), str(tmp_path / "killed")
    uninterrupted = start(full)  # runs beside the killed runs (they are all independent)

    # 1. mid-epoch, between checkpoints: step_3 and step_4 are on disk, step 6 is not reached.
    run(killed, "step:5")
    assert ckpt_names(killed) == ["step_3", "step_4"]

    # 2. in the middle of writing step_6 (resumed from step_4): a half-written step_6.tmp is
    #    left behind, without meta.json, and is not taken for a checkpoint.
    run(killed, "write:6")
    assert ckpt_names(killed) == ["step_3", "step_4", "step_6.tmp"]
    tmp = os.path.join(killed, "ckpts", "step_6.tmp")
    assert os.path.isdir(os.path.join(tmp, "state"))
    assert not os.path.exists(os.path.join(tmp, "meta.json"))
    assert latest(killed) == "step_4"

    # 3. right after step_8 (an epoch's end) is saved and the older ones pruned: the rerun
    #    starts the third epoch from its first update. (The rerun of step 2 rewrote step_6.)
    run(killed, "saved:8")
    assert ckpt_names(killed) == ["step_6", "step_8"]
    assert latest(killed) == "step_8"

    # 4. in the middle of writing the last checkpoint, step_12, at the end of training.
    run(killed, "write:12")
    assert ckpt_names(killed) == ["step_12.tmp", "step_8", "step_9"]
    assert latest(killed) == "step_9"
    assert not os.path.exists(os.path.join(killed, "final.npz"))

    # 5. the same command once more, without a kill, finishes the run.
    run(killed)
    finish(uninterrupted, 0)

    assert starts(killed) == [0, 4, 4, 8, 9]  # where each of the 5 runs started
    assert starts(full) == [0]
    assert_same_run(killed, full)
