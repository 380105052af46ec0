"""A real SLURM cluster of one node (this machine, Debian's slurm-wlm, started by ``slurm.sh``):
``redco launch --launcher slurm --wait`` submits a 2-task job of the unchanged worker, whose
``Deployer()`` detects the ``slurm`` launcher, and the job trains exactly like one process.

Needs root (apt, the daemons). If SLURM cannot be installed or started the tests FAIL, saying
why; ``REDCO_SKIP_SLURM=1`` skips them instead."""
import os
import subprocess
import sys

import pytest
from conftest import HERE, WORKER, assert_trains_like_reference, worker_env

SLURM_SH = os.path.join(HERE, "slurm.sh")
SLURM_DIR = os.environ.get("REDCO_SLURM_DIR", "/tmp/redco-slurm")


def slurm_sh(action: str) -> None:
    out = subprocess.run(["bash", SLURM_SH, action], capture_output=True, text=True,
                         timeout=600)
    if out.returncode != 0:
        why = out.stderr.strip() or out.stdout.strip()
        hint = "" if "REDCO_SKIP_SLURM" in why else "\n(REDCO_SKIP_SLURM=1 skips the SLURM tests)"
        pytest.fail(f"tests/multihost/slurm.sh {action} failed ({out.returncode}): {why}{hint}",
                    pytrace=False)


@pytest.fixture(scope="module")
def slurm():
    """Install SLURM if missing, start munged, slurmctld and slurmd; stop them afterwards.
    Yields the environment a SLURM client needs (``SLURM_CONF``)."""
    if os.environ.get("REDCO_SKIP_SLURM") == "1":
        pytest.skip("REDCO_SKIP_SLURM=1")
    slurm_sh("install")
    slurm_sh("start")
    yield worker_env(SLURM_CONF=os.path.join(SLURM_DIR, "slurm.conf"))
    slurm_sh("stop")


def redco_launch(env: dict, workdir: str, *argv: str, timeout: int = 420):
    """``redco launch --launcher slurm --nodes 1 --ntasks-per-node 2 --wait`` from ``workdir``."""
    os.makedirs(workdir, exist_ok=True)
    try:
        return subprocess.run(
            [sys.executable, "-m", "redco.cli", "launch", "--launcher", "slurm", "--nodes", "1",
             "--ntasks-per-node", "2", "--job-name", "t", "--wait", "--", *argv],
            cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", "--name", "t"], env=env)
        raise


def test_slurm_job_trains_like_one_process(slurm, reference, tmp_path):
    workdir = str(tmp_path / "run")
    out = redco_launch(slurm, str(tmp_path), sys.executable, WORKER, "detect", "4", workdir)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"redco: wrote {tmp_path}/t.sbatch" in out.stdout
    job_id = out.stdout.split("redco: submitted job ")[1].split(";")[0]
    assert f"job {job_id} COMPLETED, exit code 0 (output: {tmp_path}/t-{job_id}.out)" in out.stderr
    assert "epoch 2/2" in out.stdout  # the job's output file, printed while waiting
    with open(tmp_path / "t.sbatch") as f:
        assert f.read().splitlines()[-1].startswith("srun --kill-on-bad-exit=1 ")
    assert_trains_like_reference(workdir, 2, "slurm", reference)


def test_doctor_in_a_slurm_step(slurm, tmp_path):
    env = dict(slurm, XLA_FLAGS="--xla_force_host_platform_device_count=4")
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


def test_the_bare_body_of_an_sbatch_script_is_refused(slurm, tmp_path):
    """A script that runs python without srun in a 2-task job: the Deployer says to use srun
    (jax alone would say 'coordinator_address should be defined')."""
    from redco import launch
    script = tmp_path / "bare.sbatch"
    code = "from redco import Deployer; Deployer(jax_seed=0, loggers=())"
    script.write_text(f"#!/bin/bash\n#SBATCH --ntasks=2\n#SBATCH --output={tmp_path}/bare.out\n"
                      f"#SBATCH --chdir={tmp_path}\n{sys.executable} -c '{code}'\n")
    env = slurm
    job = subprocess.run(["sbatch", "--parsable", str(script)], env=env, capture_output=True,
                         text=True, check=True).stdout.strip()
    old = dict(os.environ)
    os.environ["SLURM_CONF"] = env["SLURM_CONF"]
    try:
        with open(os.devnull, "w") as quiet:
            assert launch.wait_for_job(job, str(tmp_path / "bare.out"), poll_s=0.5,
                                       out=quiet) == 1
    finally:
        os.environ.clear()
        os.environ.update(old)
    text = (tmp_path / "bare.out").read_text()
    assert "not a task of a job step, so there is nothing to join: run the command through " \
           "srun" in text, text[-3000:]
