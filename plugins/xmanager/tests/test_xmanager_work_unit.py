"""redco-xmanager: ``redco launch --launcher xmanager`` (offered once the plugin is installed)
runs the unchanged worker as a real XManager experiment (local executor) whose work unit is a
group of two jobs; they join through the ``ip`` launcher and train exactly like one process."""
import os
import sqlite3
import subprocess
import sys

from multihost_helpers import WORKER, assert_trains_like_reference, free_port, run_cli, worker_env

from redco import plugins
from redco_xmanager import XManagerLauncher


def launch(tmp_path, *argv):
    """``redco launch --launcher xmanager --port P ARGV...`` with its own ``~/.xmanager``."""
    env = worker_env(HOME=str(tmp_path))  # XManager keeps its database under ~/.xmanager
    return subprocess.run(
        [sys.executable, "-m", "redco.cli", "launch", "--launcher", "xmanager", "--port",
         str(free_port()), *argv], env=env, capture_output=True, text=True, timeout=600)


def experiment_titles(tmp_path) -> list[str]:
    with sqlite3.connect(tmp_path / ".xmanager" / "experiments.sqlite3") as db:
        return [title for (title,) in db.execute("SELECT experiment_title FROM experiment")]


def test_offered_by_redco_launch_and_submits_only():
    launcher = plugins.lookup("launchers", "xmanager")
    assert isinstance(launcher, XManagerLauncher) and launcher.can_submit
    assert not launcher.detect({})  # joining is the ip launcher's
    out = subprocess.run([sys.executable, "-m", "redco.cli", "launch", "--help"],
                         env=worker_env(), capture_output=True, text=True, timeout=120)
    assert "xmanager" in out.stdout.split("--launcher {")[1].split("}")[0].split(",")
    assert "--n_processes N_PROCESSES" in out.stdout and "--title TITLE" in out.stdout


def test_xmanager_work_unit_trains_like_one_process(reference, tmp_path):
    workdir = str(tmp_path / "run")
    out = launch(tmp_path, "--n-processes", "2", "--title", "lm-2p", "--", sys.executable,
                 WORKER, "detect", "4", workdir)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "[process_0]" in out.stdout and "[process_1]" in out.stdout
    assert experiment_titles(tmp_path) == ["lm-2p"]  # a real experiment, in its database
    assert_trains_like_reference(workdir, 2, "ip", reference)


def test_a_failing_job_fails_the_launch(tmp_path):
    script = "import os, sys; sys.exit(3 if os.environ['REDCO_PROCESS_ID'] == '1' else 0)"
    out = launch(tmp_path, "--", sys.executable, "-c", script)
    assert out.returncode == 1
    assert "the XManager work unit failed" in out.stderr and "returned non-zero code: 3" \
        in out.stderr
    assert experiment_titles(tmp_path) == ["redco"]


def test_no_processes_is_refused(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    code, _, err = run_cli(capsys, "launch", "--launcher", "xmanager", "--n-processes", "0",
                           "--", "python", "t.py")
    assert code == 2 and "--n_processes 0 must be at least 1" in err
    assert not os.path.exists(tmp_path / ".xmanager")  # refused before any experiment
