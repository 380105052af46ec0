"""``redco launch --launcher xmanager``: a real XManager experiment (local executor) runs the
unchanged worker as a group of two jobs that train exactly like one process."""
import os
import subprocess
import sys

import pytest
from conftest import WORKER, assert_trains_like_reference, free_port, worker_env

pytest.importorskip("xmanager", reason="pip install xmanager (tox -e multihost does)")


def launch(tmp_path, *command):
    env = worker_env(HOME=str(tmp_path))  # XManager keeps its database under ~/.xmanager
    return subprocess.run(
        [sys.executable, "-m", "redco.cli", "launch", "--launcher", "xmanager", "--n-processes",
         "2", "--port", str(free_port()), "--", *command],
        env=env, capture_output=True, text=True, timeout=600)


def test_xmanager_work_unit_trains_like_one_process(reference, tmp_path):
    workdir = str(tmp_path / "run")
    out = launch(tmp_path, sys.executable, WORKER, "detect", "4", workdir)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "[process_0]" in out.stdout and "[process_1]" in out.stdout
    assert os.path.isdir(tmp_path / ".xmanager")  # a real experiment, in its database
    assert_trains_like_reference(workdir, 2, "ip", reference)


def test_a_failing_job_fails_the_launch(tmp_path):
    script = "import os, sys; sys.exit(3 if os.environ['REDCO_PROCESS_ID'] == '1' else 0)"
    out = launch(tmp_path, sys.executable, "-c", script)
    assert out.returncode == 1
    assert "the XManager work unit failed" in out.stderr and "returned non-zero code: 3" \
        in out.stderr
