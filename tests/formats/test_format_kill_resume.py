"""The kill test for each format plugin: training killed while that format's own writer is
saving a checkpoint, then rerun with the same command, ends bitwise equal to an uninterrupted
run.

tests/core/test_kill_resume.py kills orbax, the built-in format, at four points; those points
besides the two during a save (mid-epoch, just after a save) do not touch the format. Here each
plugin format is killed once, at one of the two that do (kill_worker.py), the two formats taking
one each: safetensors' writer stopped by the kernel at its first byte of step_6 (its files left
empty), msgpack's part way through writing step_6; the rerun removes step_6.tmp, reads step_4
back through the format and finishes. (Each kill costs a worker process; orbax in
tests/core takes both points.) An uninterrupted run never reads a checkpoint, so one serves as
the reference for every format.
"""
import json
import os

import pytest
from ckpt_helpers import assert_same_run, ckpt_names, finish, run, run_killed_mid_save, start, starts


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


@pytest.mark.parametrize("fmt, kill", [("safetensors", "create:6"), ("msgpack", "write:6")])
def test_killed_while_writing_and_rerun_matches_an_uninterrupted_run(fmt, kill, uninterrupted,
                                                                     tmp_path):
    killed = str(tmp_path / "killed")
    run_killed_mid_save(killed, kill, previous="step_4", fmt=fmt)
    assert ckpt_names(killed) == ["step_3", "step_4", "step_6.tmp"]
    with open(os.path.join(killed, "ckpts", "step_4", "meta.json")) as f:
        assert json.load(f)["format"] == fmt

    run(killed, fmt=fmt)  # step_6.tmp removed, step_4 read back through the format
    assert starts(killed) == [0, 4]
    assert_same_run(killed, uninterrupted())
