"""redco-slurm without a cluster: the plugin is found through its entry point and offered by
``redco launch``; the sbatch script ``--dry-run`` prints; detection from the SLURM_* variables
(before the ``ip`` launcher's REDCO_* variables, after explicit ``Deployer`` arguments); what
``redco doctor`` says; the early errors of a bare sbatch body and of a task id out of range."""
import os
import subprocess
import sys

import jax
import pytest
from multihost_helpers import deployer_error, run_cli, worker_env

from redco import plugins
from redco_ip.join import HEARTBEAT_TIMEOUT_S
from redco_slurm import SlurmLauncher

NO_PROCESS_ARGS = dict(n_processes=None, host0_address=None, host0_port=None, process_id=None)
SLURM_STEP = dict(SLURM_JOB_ID="5", SLURM_NTASKS="2", SLURM_PROCID="1", SLURM_LOCALID="1",
                  SLURM_STEP_ID="0", SLURM_STEP_NODELIST="localhost", SLURM_NODEID="0",
                  SLURM_STEP_TASKS_PER_NODE="2")
REDCO_ENV = dict(REDCO_N_PROCESSES="2", REDCO_HOST0_ADDRESS="127.0.0.1", REDCO_HOST0_PORT="1",
                 REDCO_PROCESS_ID="1")


def redco_cli(*argv: str, **env: str) -> subprocess.CompletedProcess:
    """``redco ARGV...`` as a user runs it, in a fresh process."""
    return subprocess.run([sys.executable, "-m", "redco.cli", *argv], env=worker_env(**env),
                          capture_output=True, text=True, timeout=120)


# ---- installed as a plugin -------------------------------------------------------------------
def test_registered_through_its_entry_point():
    assert isinstance(plugins.lookup("launchers", "slurm"), SlurmLauncher)
    out = redco_cli("plugins")
    assert any(line.split()[:4] == ["slurm", "redco-slurm", "0.5.0", "register_launchers"]
               for line in out.stdout.splitlines()), out.stdout


def test_launch_help_lists_slurm_and_its_options():
    out = redco_cli("launch", "--help")
    assert out.returncode == 0, out.stderr
    choices = out.stdout.split("--launcher {")[1].split("}")[0].split(",")
    assert "slurm" in choices and "ip" in choices
    assert "slurm: write an sbatch script running the command under srun, and submit it" \
        in out.stdout
    for option in ("--nodes", "--ntasks_per_node", "--partition", "--time", "--cpus_per_task",
                   "--gpus_per_node", "--job_name", "--sbatch", "--workdir", "--dry_run",
                   "--wait"):
        assert f"  {option} " in out.stdout or f"  {option}\n" in out.stdout, option


def test_without_the_plugin_there_is_no_slurm(capsys):
    """Only the ip plugin loaded: slurm is neither offered by redco launch nor detected."""
    out = redco_cli("launch", "--help", REDCO_PLUGINS="ip")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("--launcher {")[1].split("}")[0] == "ip"
    out = redco_cli("launch", "--launcher", "slurm", "--", "python", "t.py", REDCO_PLUGINS="ip")
    assert out.returncode == 2 and "argument --launcher: invalid choice: 'slurm'" in out.stderr


# ---- redco launch --launcher slurm --dry-run -------------------------------------------------
def test_sbatch_script_from_dry_run(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, _ = run_cli(capsys, "launch", "--launcher", "slurm", "--nodes", "2",
                           "--ntasks-per-node", "4", "--partition", "gpu", "--time", "1:00:00",
                           "--cpus-per-task", "8", "--gpus-per-node", "4", "--job-name", "lm",
                           "--sbatch=--account=abc", "--dry-run", "--",
                           "python", "train.py", "--lr", "1e-3", "two words")
    assert code == 0
    lines = out.splitlines()
    assert lines[:13] == ["#!/bin/bash",
                          "#SBATCH --job-name=lm",
                          "#SBATCH --nodes=2",
                          "#SBATCH --ntasks-per-node=4",
                          f"#SBATCH --output={tmp_path}/lm-%j.out",
                          "#SBATCH --open-mode=append",
                          f"#SBATCH --chdir={tmp_path}",
                          "#SBATCH --partition=gpu",
                          "#SBATCH --time=1:00:00",
                          "#SBATCH --cpus-per-task=8",
                          "#SBATCH --gpus-per-node=4",
                          "#SBATCH --account=abc",
                          ""]
    assert lines[-1] == "srun --kill-on-bad-exit=1 python train.py --lr 1e-3 'two words'"
    assert "8 tasks (2 nodes x 4), each one JAX process" in out
    assert "# Safe to run again: a requeued job (e.g. after preemption) appends to the same " \
           "output" in out and "redco resumes from the last step checkpoint" in out
    assert "--requeue" not in out and "scontrol" not in out  # not forced: --requeue asks for it
    assert os.listdir(tmp_path) == []  # a dry run writes and submits nothing


def test_requeue_asks_for_the_warning_signal_and_requeues_a_clean_stop(capsys, tmp_path,
                                                                      monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, _ = run_cli(capsys, "launch", "--launcher", "slurm", "--time", "4:00:00",
                           "--requeue", "--signal-before", "300", "--dry-run", "--", "python",
                           "train.py")
    assert code == 0
    lines = out.splitlines()
    assert "#SBATCH --requeue" in lines and "#SBATCH --signal=TERM@300" in lines
    srun = lines.index("srun --kill-on-bad-exit=1 python train.py")
    assert lines[srun + 1] == "status=$?"
    assert 'if [ "$status" -eq 143 ]; then scontrol requeue "$SLURM_JOB_ID"; fi' in lines[srun:]
    assert lines[-1] == "exit $status"


def test_the_script_gives_srun_the_command_word_for_word(capsys, tmp_path, monkeypatch):
    """bash runs the dry-run script with ``srun`` standing in as a function that prints its
    arguments: the command arrives unchanged, quotes, ``$`` and backquotes included."""
    monkeypatch.chdir(tmp_path)
    command = ["python", "-c", "print(\"it's $HOME `x`\")", "two words", ""]
    _, out, _ = run_cli(capsys, "launch", "--launcher", "slurm", "--dry-run", "--", *command)
    (tmp_path / "s.sbatch").write_text(out)
    ran = subprocess.run(["bash", "-c", 'srun() { printf "%s\\0" "$@"; }; . ./s.sbatch'],
                         capture_output=True, text=True, check=True)
    assert ran.stdout.split("\0")[:-1] == ["--kill-on-bad-exit=1", *command]


def test_slurm_launch_mistakes_are_refused(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(capsys, "launch", "--launcher", "slurm", "--nodes", "1")
    assert code == 2 and "no command: put it after `--`" in err
    code, _, err = run_cli(capsys, "launch", "--launcher", "slurm", "--nodes", "0", "--dry-run",
                           "--", "python", "t.py")
    assert code == 2 and "--nodes 0 --ntasks_per_node 1: both must be at least 1" in err
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch anywhere
    code, _, err = run_cli(capsys, "launch", "--launcher", "slurm", "--", "python", "t.py")
    assert code == 2 and "`sbatch` is not on PATH: run this on a SLURM login node" in err


# ---- detection -------------------------------------------------------------------------------
def detected(**config) -> str:
    config = {**NO_PROCESS_ARGS, **config}
    return next(name for name, ln in plugins.registry("launchers").items() if ln.detect(config))


@pytest.mark.parametrize("env, config, expected", [
    (SLURM_STEP, {}, "slurm"),
    ({**SLURM_STEP, **REDCO_ENV}, {}, "slurm"),             # a SLURM step before REDCO_*
    (SLURM_STEP, {"n_processes": 2}, "ip"),                 # explicit arguments before all
    (dict(SLURM_STEP, SLURM_NTASKS="1"), {}, "local"),      # srun -n 1: one process
    (dict(SLURM_JOB_ID="5", SLURM_NTASKS="2"), {}, "slurm"),  # bare sbatch body: refused later
    (dict(SLURM_JOB_ID="5", SLURM_NTASKS="2", **REDCO_ENV), {}, "ip"),
    (REDCO_ENV, {}, "ip"),                                  # no SLURM: not slurm's
], ids=["slurm-step", "slurm-over-env", "args-first", "one-task", "sbatch-body",
        "sbatch-body-with-env", "redco-env"])
def test_detection_order(clean_env, env, config, expected):
    for key, value in env.items():
        clean_env.setenv(key, value)
    assert detected(**config) == expected


def test_one_task_per_node_gets_all_its_devices(clean_env, monkeypatch):
    """jax would keep one GPU (SLURM_LOCALID) per task; with one task on the node, redco asks
    for all of them (local_device_ids=[] turns jax's restriction off)."""
    seen = {}
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: seen.update(kw))
    for key, value in dict(SLURM_STEP, SLURM_STEP_TASKS_PER_NODE="1(x2)", SLURM_NODEID="1",
                           SLURM_NTASKS="2").items():
        clean_env.setenv(key, value)
    slurm = plugins.lookup("launchers", "slurm")
    slurm.initialize(dict(NO_PROCESS_ARGS))
    assert seen == {"cluster_detection_method": "slurm", "local_device_ids": [],
                    "heartbeat_timeout_seconds": HEARTBEAT_TIMEOUT_S}
    clean_env.setenv("SLURM_STEP_TASKS_PER_NODE", "2")
    clean_env.setenv("SLURM_NODEID", "0")
    slurm.initialize(dict(NO_PROCESS_ARGS))
    assert seen["local_device_ids"] is None  # several tasks per node: jax's one device each
    slurm.initialize(dict(NO_PROCESS_ARGS, n_local_devices=3))
    assert seen["local_device_ids"] == [0, 1, 2]  # Deployer(n_local_devices=3)


# ---- early errors ----------------------------------------------------------------------------
def test_bare_sbatch_body_says_run_through_srun(clean_env, no_jax_distributed, tmp_path):
    for key, value in dict(SLURM_JOB_ID="9", SLURM_NTASKS="4", SLURM_PROCID="0",
                           SLURM_LOCALID="0").items():
        clean_env.setenv(key, value)
    assert deployer_error(tmp_path) == (
        "This is the body of the sbatch script of SLURM job 9 (4 tasks), not a task of a job "
        "step, so there is nothing to join: run the command through srun (`srun python "
        "train.py ...` in the script), or let `redco launch --launcher slurm ... -- python "
        "train.py ...` write and submit the script.")


def test_slurm_task_id_beyond_the_count(clean_env, no_jax_distributed, tmp_path):
    for key, value in dict(SLURM_STEP, SLURM_PROCID="2").items():
        clean_env.setenv(key, value)
    assert "process_id=2 but n_processes=2 (SLURM): ids run from 0 to 1" in \
        deployer_error(tmp_path)


# ---- redco doctor ----------------------------------------------------------------------------
def test_doctor_outside_slurm_says_so_and_tries_slurm_first(tmp_path):
    out = redco_cli("doctor", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:2] == ["launchers (tried in this order):",
                         "    slurm    not detected: not in a SLURM job (no SLURM_JOB_ID)"]
    assert "launcher: local" in lines


def test_doctor_says_why_slurm_refuses_a_bare_sbatch_body():
    out = redco_cli("doctor", SLURM_JOB_ID="41", SLURM_NTASKS="2", SLURM_PROCID="0",
                    SLURM_LOCALID="0")
    assert out.returncode != 0
    assert (" -> slurm    detected: SLURM job 41 with 2 tasks, but this is the batch script "
            "itself, not a task of an srun step") in out.stdout
    assert "run the command through srun" in out.stderr


def test_explain_names_the_coordinator_jax_derives(clean_env):
    """``redco._private.slurm_coordinator_address``, JAX's own SLURM parsing, run for real."""
    clean_env.delenv("JAX_COORDINATOR_PORT", raising=False)
    for key, value in dict(SLURM_STEP, SLURM_JOB_ID="4100",
                           SLURM_STEP_NODELIST="gpu[007-009]").items():
        clean_env.setenv(key, value)
    slurm = plugins.lookup("launchers", "slurm")
    assert slurm.explain(dict(NO_PROCESS_ARGS)) == (
        f"task 1 of 2 of step 0 of SLURM job 4100 on gpu[007-009]; coordinator gpu007:"
        f"{4100 % 4096 + 61440}")
    clean_env.delenv("SLURM_STEP_NODELIST")
    assert slurm.explain(dict(NO_PROCESS_ARGS)).endswith(
        "; coordinator unknown (no SLURM_STEP_NODELIST)")
