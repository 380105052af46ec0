"""The kill test: a training process killed at several points (mid-epoch, while the format is
writing a checkpoint, right after a checkpoint, ...) and rerun with the same command each time
ends with params bitwise equal to those of an uninterrupted run. Orbax, the built-in format,
here; tests/formats/test_format_kill_resume.py stops every plugin format's writer the same way.

The two kills during a save stop orbax's own writer (its tensorstore threads) inside a write
call, through a file-size limit (kill_worker.py): at its first byte, and part way through its
biggest file. Each leaves a ``.tmp`` that is not taken for a checkpoint and is removed on resume.
"""
import os

from ckpt_helpers import (
    assert_same_run,
    ckpt_names,
    finish,
    goodput_runs,
    latest,
    run,
    run_killed_mid_save,
    start,
    starts,
)


def test_killed_training_rerun_until_done_matches_an_uninterrupted_run(tmp_path, uninterrupted):
    # 4 updates an epoch, 3 epochs; checkpoints at steps 3, 4 (epoch end), 6, 8 (epoch end),
    # 9 and 12 (epoch end), the last two kept. The uninterrupted run (conftest.py) runs beside
    # the killed runs (they are all independent).
    killed = str(tmp_path / "killed")

    # 1. mid-epoch, between checkpoints: step_3 and step_4 are on disk, step 6 is not reached.
    run(killed, "step:5")
    assert ckpt_names(killed) == ["step_3", "step_4"]

    # 2. as orbax writes the first byte of step_6 (resumed from step_4): step_6.tmp holds only
    #    the empty file(s) orbax had created, and step_4 stays the newest checkpoint.
    run_killed_mid_save(killed, "create:6", previous="step_4")
    assert ckpt_names(killed) == ["step_3", "step_4", "step_6.tmp"]

    # 3. right after step_8 (an epoch's end) is saved and the older ones pruned: the rerun
    #    starts the third epoch from its first update. (The rerun of step 2 removed step_6.tmp
    #    and wrote step_6.)
    run(killed, "saved:8")
    assert ckpt_names(killed) == ["step_6", "step_8"]
    assert latest(killed) == "step_8"

    # 4. part way through orbax's writing of the last checkpoint, step_12, at the end of
    #    training: one of its files is cut at half the size of step_9's biggest one.
    left = run_killed_mid_save(killed, "write:12", previous="step_9")
    assert ckpt_names(killed) == ["step_12.tmp", "step_8", "step_9"]
    assert len(left) > 1  # orbax had written other files before
    assert not os.path.exists(os.path.join(killed, "final.npz"))

    # 5. the same command once more, without a kill, finishes the run.
    run(killed)
    full = uninterrupted.workdir()

    assert starts(killed) == [0, 4, 4, 8, 9]  # where each of the 5 runs started
    assert starts(full) == [0]
    assert_same_run(killed, full)

    # goodput.json keeps every run: the updates each redid that an earlier one had reached
    # (run 2 redid 5; run 3 redid 5 and 6; run 5, from step_9, redid 10 to 12), with their time.
    runs = goodput_runs(killed)
    assert [(r["first_step"], r["last_step"]) for r in runs] == [(0, 5), (4, 6), (4, 8), (8, 12),
                                                                  (9, 12)]
    assert [r["replayed_steps"] for r in runs] == [0, 1, 2, 0, 3]
    assert [r["replayed"] > 0 for r in runs] == [False, True, True, False, True]
    assert [r["replayed_steps"] for r in goodput_runs(full)] == [0]



def test_a_packed_corpus_run_killed_anywhere_reruns_to_the_same_bits(tmp_path):
    """The same, training on a token file's packed rows read from disk: killed mid-epoch in the
    second epoch, the rerun resumes from the mid-epoch step_6 at the example it stood at (the
    epoch's order and the offset in it both restored). The kill right after an epoch's
    checkpoint is the test above's (a pure repeat here: its rerun starts an epoch at its
    first example)."""
    full, killed = str(tmp_path / "full"), str(tmp_path / "killed")
    uninterrupted = start(full, data="packed")
    run(killed, "step:7", data="packed")
    run(killed, data="packed")
    finish(uninterrupted, 0)
    assert starts(killed) == [0, 6]
    assert_same_run(killed, full)
