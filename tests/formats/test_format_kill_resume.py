"""The kill test for each format plugin: training SIGKILLed in the middle of writing a checkpoint
in that format, then rerun with the same command, ends bitwise equal to an uninterrupted run.

tests/core/test_kill_resume.py kills orbax, the built-in format, at four points; those points
besides the mid-write one (mid-epoch, just after a save) do not touch the format. Here each
plugin format gets the point that does: a half-written ``step_6.tmp`` of its own files, then a
rerun that reads step_4 back through the format and finishes. An uninterrupted run never reads
a checkpoint, so one serves as the reference for every format.
"""
import json
import os

import pytest
from ckpt_helpers import assert_same_run, ckpt_names, finish, latest, run, start, starts


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The workdir of a run that was never killed; it runs beside the first killed run."""
    workdir = str(tmp_path_factory.mktemp("full") / "workdir")
    proc = start(workdir)
    done = []

    def wait() -> str:
        if not done:
            finish(proc, 0)
            done.append(workdir)
        return workdir
    yield wait
    if not done and proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("fmt", ["safetensors", "msgpack"])
def test_killed_mid_write_and_rerun_matches_an_uninterrupted_run(fmt, uninterrupted, tmp_path):
    killed = str(tmp_path / "killed")
    run(killed, "write:6", fmt)
    assert ckpt_names(killed) == ["step_3", "step_4", "step_6.tmp"]
    tmp = os.path.join(killed, "ckpts", "step_6.tmp")
    assert not os.path.exists(os.path.join(tmp, "meta.json"))
    assert latest(killed) == "step_4"
    with open(os.path.join(killed, "ckpts", "step_4", "meta.json")) as f:
        assert json.load(f)["format"] == fmt

    run(killed, fmt=fmt)
    assert starts(killed) == [0, 4]
    assert_same_run(killed, uninterrupted())
