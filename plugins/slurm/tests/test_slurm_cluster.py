"""A real SLURM cluster of one node (this machine, Debian's slurm-wlm, started by ``slurm.sh``):
``redco launch --launcher slurm --wait`` (offered by this plugin) submits a 2-task job of the
unchanged worker, whose ``Deployer()`` detects this plugin's ``slurm`` launcher, and the job
trains exactly like one process; a failed task ends the job with its exit code; a job requeued
mid-run (as a preempted one is) appends to its output and resumes from its step checkpoint; a
job started with ``--requeue`` and sent SIGTERM mid-epoch saves, requeues itself and resumes to
the bits of an uninterrupted run.

Needs root (apt, the daemons). If SLURM cannot be installed or started the tests FAIL, saying
why; ``REDCO_SKIP_SLURM=1`` skips them instead."""
import contextlib
import glob
import os
import re
import shlex
import subprocess
import sys
import time

import numpy as np
import pytest
from multihost_helpers import (
    WORKER,
    read_results,
    simulated_devices,
    wait_until,
)

from redco_slurm.sbatch import job_state, wait_for_job

LAUNCH = [sys.executable, "-m", "redco.cli", "launch", "--launcher", "slurm", "--nodes", "1",
          "--ntasks-per-node", "2", "--job-name", "t", "--wait", "--"]


def redco_launch(env: dict, workdir: str, *argv: str, timeout: int = 420):
    """``redco launch --launcher slurm --nodes 1 --ntasks-per-node 2 --wait`` from ``workdir``."""
    os.makedirs(workdir, exist_ok=True)
    try:
        return subprocess.run([*LAUNCH, *argv], cwd=workdir, env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", "--name", "t"], env=env)
        raise


def test_doctor_in_a_slurm_step(slurm, tmp_path):
    env = dict(slurm, XLA_FLAGS=simulated_devices(4))
    out = redco_launch(env, str(tmp_path), sys.executable, "-m", "redco.cli", "doctor")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count(" -> slurm    detected: task ") == 2
    assert out.stdout.count("launcher: slurm") == 2
    assert "process: 0 of 2" in out.stdout and "process: 1 of 2" in out.stdout
    assert out.stdout.count("devices: 8 in all, 4 here, platform cpu, kind cpu") == 2
    assert "mesh of Deployer(n_model_shards=1): {'dp': 8, 'mp': 1}" in out.stdout


def test_a_failed_task_ends_the_job_with_its_exit_code(slurm, tmp_path):
    """Task 1 exits 3 at once; srun stops task 0 (which would sleep 5 minutes) at once, and
    `--wait` exits with the job's exit code: srun's, the highest of its tasks, here task 0's
    SIGTERM (128 + 15)."""
    script = ("import os, sys, time\n"
              "if os.environ['SLURM_PROCID'] == '1': sys.exit(3)\n"
              "time.sleep(300)\n")
    out = redco_launch(slurm, str(tmp_path), sys.executable, "-c", script, timeout=120)
    assert out.returncode == 143, out.stdout[-3000:] + out.stderr[-3000:]
    assert "task 1: Exited with exit code 3" in out.stdout  # the job's output, printed
    assert "FAILED, exit code 143" in out.stderr


def test_the_bare_body_of_an_sbatch_script_is_refused(slurm, tmp_path, monkeypatch):
    """A script that runs python without srun in a 2-task job: the Deployer says to use srun
    (jax alone would say 'coordinator_address should be defined')."""
    script = tmp_path / "bare.sbatch"
    code = "from redco import Deployer; Deployer(jax_seed=0, loggers=())"
    script.write_text(f"#!/bin/bash\n#SBATCH --ntasks=2\n#SBATCH --output={tmp_path}/bare.out\n"
                      f"#SBATCH --chdir={tmp_path}\n{sys.executable} -c '{code}'\n")
    job = subprocess.run(["sbatch", "--parsable", str(script)], env=slurm, capture_output=True,
                         text=True, check=True).stdout.strip()
    monkeypatch.setenv("SLURM_CONF", slurm["SLURM_CONF"])
    with open(os.devnull, "w") as quiet:
        assert wait_for_job(job, str(tmp_path / "bare.out"), poll_s=0.5, out=quiet) == 1
    text = (tmp_path / "bare.out").read_text()
    assert "not a task of a job step, so there is nothing to join: run the command through " \
           "srun" in text, text[-3000:]


def start_requeued_job_now(job_id: str) -> None:
    """SLURM holds a requeued job back for a while (reason BeginTime): once the job is pending
    and its node idle, start it. Not within the second the requeue's kill was in: slurmd
    revokes the old run's credentials to the second, so a job started in that second is refused
    ("Job credential revoked", the job FAILED with exit code 1). The kill ended before the node
    was seen idle, so once the clock has left that second, the start is after the revocation."""
    wait_until(lambda: (job_state(job_id) or "").startswith("PENDING"), "requeued", 120, 0.2)
    wait_until(lambda: subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True,
                                      text=True).stdout.strip().startswith("idle"), "idle", 120, 0.2)
    idle_second = int(time.time())
    wait_until(lambda: int(time.time()) > idle_second,
               "the second in which the node was seen idle has passed", 5, 0.01)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True)


@contextlib.contextmanager
def cancelled_on_error(launch: subprocess.Popen):
    """Cancel the test's jobs and stop ``launch`` if the block fails (or times out)."""
    try:
        yield
    except BaseException:
        subprocess.run(["scancel", "--name", "t"])
        launch.kill()
        raise


def requeue_and_finish(launch: subprocess.Popen, tmp_path,
                       command: list[str]) -> tuple[str, str, str, str]:
    """Send the running job of ``launch`` (``redco launch ... --wait``) ``command`` + its id,
    start it again at once, and require ``--wait`` to follow it to COMPLETED, exit code 0; the
    job's output file and id, and ``redco launch``'s stdout and stderr."""
    with cancelled_on_error(launch):
        [output] = glob.glob(str(tmp_path / "t-*.out"))
        job_id = output.rsplit("-", 1)[1].removesuffix(".out")
        subprocess.run([*command, job_id], check=True)
        start_requeued_job_now(job_id)
        stdout, stderr = launch.communicate(timeout=300)
    assert launch.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert f"job {job_id} COMPLETED, exit code 0 (output: {output})" in stderr
    return output, job_id, stdout, stderr


@pytest.mark.slow
def test_a_requeued_job_appends_and_resumes_from_its_checkpoint(slurm, reference, tmp_path,
                                                                monkeypatch):
    """A preemption, for real: the job's first run trains one epoch (checkpoint step_4) and
    waits; the test requeues the job (``scontrol requeue``, what SLURM does to a preempted job
    on a requeueing partition) and lets it start again at once. The same script runs again:
    ``--open-mode=append`` keeps the first run's output, the worker resumes from step_4 and
    trains steps 5-8 exactly as the uninterrupted reference did, and ``--wait`` follows the job
    through the requeue to its exit code 0. Slow tier (``REDCO_SLOW_TESTS=1``): the requeue
    below, in CI, asserts the same append, resume and ``--wait`` through a requeue."""
    monkeypatch.setenv("SLURM_CONF", slurm["SLURM_CONF"])
    workdir = tmp_path / "run"
    worker = shlex.join([sys.executable, WORKER, "detect", "4", str(workdir)])
    # The first run's tasks sleep once their worker has exited (each says so with a file), so
    # the requeue finds nothing but `sleep` to stop.
    done = shlex.quote(str(workdir / "first-run-"))
    body = (f'if [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then REDCO_TEST_EPOCHS=1 {worker} && '
            f"touch {done}$SLURM_PROCID && exec sleep 600; else {worker}; fi")
    launch = subprocess.Popen([*LAUNCH, "bash", "-c", body], cwd=tmp_path, env=slurm,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with cancelled_on_error(launch):
        wait_until(lambda: all((workdir / f"first-run-{i}").exists() for i in range(2)),
                   "the first run trained", 300, 0.2)
        first = [workdir / f"result_{i}.json" for i in range(2)]
        for p in first + [workdir / "params.npz"]:
            p.unlink()  # what the test reads afterwards is the second run's
    output, job_id, _, _ = requeue_and_finish(launch, tmp_path, ["scontrol", "requeue"])
    text = open(output).read()
    first_run, _, second_run = text.partition("DUE TO JOB REQUEUE")  # SLURM's words, in the file
    assert "epoch 1/1" in first_run and "Resumed from" not in first_run, text[-3000:]
    assert f"Resumed from {workdir}/ckpts/step_4 (step 4)." in second_run
    assert "epoch 2/2" in second_run and "epoch 1/2" not in second_run
    ref, ref_params = reference
    for result in read_results(str(workdir), 2):
        assert result["launcher"] == "slurm"
        np.testing.assert_allclose(result["losses"], ref["losses"][4:], rtol=1e-5, atol=1e-5)
        assert result["preds"] == ref["preds"]
    params = np.load(workdir / "params.npz")
    for name in ref_params:
        np.testing.assert_allclose(params[name], ref_params[name], rtol=1e-5, atol=1e-5)


def train_rows(workdir) -> int:
    try:
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            return sum('"train/loss"' in line for line in f)
    except FileNotFoundError:
        return 0


def test_requeue_saves_on_sigterm_requeues_and_resumes_to_the_same_bits(slurm, tmp_path,
                                                                        monkeypatch, reference,
                                                                        two_processes):
    """``redco launch --launcher slurm --requeue --wait`` writes the sbatch script and submits
    a 2-task job of the unchanged worker, whose ``Deployer()`` detects the ``slurm`` launcher.
    ``scancel --signal=TERM`` mid-epoch (what ``--signal`` sends before a time limit) makes both
    tasks finish the same step, write its checkpoint and exit 143; the script requeues the job,
    which resumes from it, trains the rest like one process and ends with params bitwise equal
    to an uninterrupted 2-process run on 127.0.0.1 (4 devices each). ``--wait`` prints the job's
    output while it runs and ends with its exit code; the job's output file holds both runs,
    the stopped one first (``--open-mode=append``)."""
    monkeypatch.setenv("SLURM_CONF", slurm["SLURM_CONF"])
    workdir = tmp_path / "run"
    launch = subprocess.Popen([*LAUNCH[:-1], "--requeue", "--", sys.executable, WORKER, "detect",
                               "4", str(workdir)], cwd=tmp_path, env=slurm,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with cancelled_on_error(launch):
        wait_until(lambda: train_rows(workdir) >= 2, "two steps were trained", 300)
    output, _, stdout, _ = requeue_and_finish(launch, tmp_path, ["scancel", "--signal=TERM"])
    assert_script_written_and_output_followed(tmp_path, stdout)
    text = open(output).read()
    first_run, stopped, second_run = text.partition("Stopped by SIGTERM after step")
    assert stopped and "Resumed from" not in first_run and "Resumed from" in second_run, \
        f"--open-mode=append: the job's output file keeps the first run's output: {text[-3000:]}"
    with open(workdir / "log.txt") as f:
        log = f.read()
    stopped = re.findall(r"Stopped by SIGTERM after step (\d+): saved", log)
    assert len(stopped) == 1 and 2 <= int(stopped[0]) < 8, log[-3000:]
    assert f"Resumed from {workdir}/ckpts/step_{stopped[0]} (step {stopped[0]})." in log
    assert_resumed_like_reference(str(workdir), int(stopped[0]), reference)
    a = np.load(os.path.join(two_processes, "params.npz"))  # (multihost_helpers' run)
    b = np.load(workdir / "params.npz")
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(b[name], a[name], err_msg=name)


def assert_script_written_and_output_followed(tmp_path, stdout: str) -> None:
    """``redco launch`` wrote ``t.sbatch`` (appending, requeueing, srun running the command)
    and, with ``--wait``, printed the job's output file as it grew."""
    assert f"redco: wrote {tmp_path}/t.sbatch" in stdout
    assert "epoch 2/2" in stdout  # the job's output file, printed while waiting
    script = (tmp_path / "t.sbatch").read_text().splitlines()
    assert "#SBATCH --open-mode=append" in script and "#SBATCH --requeue" in script
    assert any(line.startswith("srun --kill-on-bad-exit=1 ") for line in script), script


def assert_resumed_like_reference(workdir: str, step: int, reference) -> None:
    """Both tasks of the resumed run detected SLURM, saw all 8 devices (4 their own), read only
    their half of the examples left after ``step`` and trained those updates, and predicted,
    like one process of 8 devices (to 1e-5); the last checkpoint is ``step_8``."""
    ref, _ = reference
    results = read_results(workdir, 2)
    for r in results:
        assert r["launcher"] == "slurm"
        assert (r["process_count"], r["devices"], r["local_devices"]) == (2, 8, 4)
        assert r["examples_read"] == (8 - step) * 8 // 2, r["examples_read"]  # batch 8, 2 tasks
        np.testing.assert_allclose(r["losses"], ref["losses"][step:], rtol=1e-5, atol=1e-5)
        assert r["preds"] == ref["preds"]
    assert results[0]["ckpts"][-1] == "step_8"
