"""redco-ip without a cluster: ``redco launch --launcher ip`` (the command lines, ``--run`` with two
local processes that really train), ``redco doctor``, launcher detection, and the early errors for
classic mistakes. Several processes joined through the ip launcher training like one, and
checkpoints moving between process counts, are core's tests (``tests/multihost``); the SLURM and
XManager launchers' tests are in their plugins (``plugins/*/tests``)."""
import os
import subprocess
import sys

import pytest
from multihost_helpers import (
    assert_trains_like_reference,
    deployer_error,
    run_cli,
    simulated_devices,
    worker_env,
)

from redco import plugins

REMOTE = ("198.51.100.7", "198.51.100.8")  # TEST-NET-2: never this machine, never contacted
NO_PROCESS_ARGS = dict(n_processes=None, host0_address=None, host0_port=None, process_id=None)


# ---- redco launch --launcher ip --------------------------------------------------------------
def test_ip_prints_one_command_line_per_host(capsys):
    code, out, _ = run_cli(capsys, "launch", "--launcher", "ip", "--hosts", ",".join(REMOTE),
                           "--port", "23456", "--", "python", "train.py", "--n", "1")
    assert code == 0
    commands = [line for line in out.splitlines() if not line.startswith("#")]
    hosts = ",".join(REMOTE)
    assert commands == [
        f"REDCO_HOSTS={hosts} REDCO_N_PROCESSES=2 REDCO_HOST0_ADDRESS={REMOTE[0]} "
        f"REDCO_HOST0_PORT=23456 REDCO_PROCESS_ID={i} python train.py --n 1" for i in range(2)]
    assert f"# process 1 on {REMOTE[1]}" in out


def test_ip_loopback_host0_with_remote_hosts_is_refused(capsys):
    code, out, err = run_cli(capsys, "launch", "--launcher", "ip", "--hosts",
                             f"localhost,{REMOTE[1]}", "--", "python", "train.py")
    assert code == 2 and out == ""
    assert (f"host0_address='localhost' resolves to loopback (127.0.0.1), which the processes on "
            f"{REMOTE[1]} cannot reach: give host 0's address on the network") in err


def test_ip_run_refuses_hosts_that_are_not_this_machine(capsys):
    code, _, err = run_cli(capsys, "launch", "--launcher", "ip", "--hosts", ",".join(REMOTE),
                           "--run", "--", "python", "train.py")
    assert code == 2
    assert f"--run starts processes on this machine only, and {', '.join(REMOTE)} are not " \
           "this machine" in err


def test_ip_run_two_local_processes_train_like_one(two_processes, reference):
    """`redco launch --launcher ip --run` starts the unchanged worker twice; its Deployer() finds
    the REDCO_* variables and the two processes train exactly like one (the run is
    ``multihost_helpers.two_process_run``, shared with the core tests that resume like it)."""
    with open(os.path.join(two_processes, "launch_stdout.txt")) as f:
        out = f.read()
    assert "[0] " in out and "[1] " in out  # each line names its process
    assert_trains_like_reference(two_processes, 2, "ip", reference)


def test_ip_run_returns_the_failing_exit_code_and_stops_the_others(tmp_path):
    script = ("import os, sys, time\n"
              "if os.environ['REDCO_PROCESS_ID'] == '1': sys.exit(7)\n"
              "time.sleep(120)\n")
    out = subprocess.run(
        [sys.executable, "-m", "redco.cli", "launch", "--launcher", "ip", "--hosts",
         "localhost,localhost", "--run", "--", sys.executable, "-c", script],
        env=worker_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 7
    assert "process 1 exited with code 7; stopping the others" in out.stderr


# ---- redco doctor ----------------------------------------------------------------------------
def test_doctor_one_process(tmp_path):
    out = subprocess.run([sys.executable, "-m", "redco.cli", "doctor"], cwd=tmp_path,
                         env=worker_env(XLA_FLAGS=simulated_devices(8)),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "launchers (tried in this order):"
    assert ("    ip       not detected: no n_processes argument and no REDCO_N_PROCESSES > 1"
            in lines)  # launcher plugins' lines (slurm, xmanager) come between: their tests
    assert lines[lines.index("launcher: local") - 1] == \
        " -> local    detected: one process (the fallback)"
    assert "launcher: local" in lines
    assert "process: 0 of 1" in lines
    assert "devices: 8 in all, 8 here, platform cpu, kind cpu" in lines
    assert ("mesh of Deployer(n_model_shards=1): {'dp': 8, 'mp': 1}, device ids by dp row: "
            "[[0], [1], [2], [3], [4], [5], [6], [7]]") in lines


# ---- detection order -------------------------------------------------------------------------
def detected(**config) -> str:
    config = {**NO_PROCESS_ARGS, **config}
    return next(name for name, ln in plugins.registry("launchers").items() if ln.detect(config))


REDCO_ENV = dict(REDCO_N_PROCESSES="2", REDCO_HOST0_ADDRESS="127.0.0.1", REDCO_HOST0_PORT="1",
                 REDCO_PROCESS_ID="1")


@pytest.mark.parametrize("env, config, expected", [
    ({}, {}, "local"),
    (REDCO_ENV, {}, "ip"),
    (dict(REDCO_ENV, REDCO_N_PROCESSES="1"), {}, "local"),
], ids=["nothing", "redco-env", "redco-env-1"])  # with SLURM: plugins/slurm/tests
def test_detection_order(clean_env, env, config, expected):
    for key, value in env.items():
        clean_env.setenv(key, value)
    assert detected(**config) == expected


# ---- early errors ----------------------------------------------------------------------------
def test_loopback_host0_with_remote_hosts(clean_env, no_jax_distributed, tmp_path):
    clean_env.setenv("REDCO_HOSTS", f"127.0.0.1,{REMOTE[0]}")
    message = deployer_error(tmp_path, n_processes=2, host0_address="127.0.0.1", host0_port=1234,
                             process_id=1)
    assert message.startswith(
        f"host0_address='127.0.0.1' resolves to loopback (127.0.0.1), which the processes on "
        f"{REMOTE[0]} cannot reach")


def test_hosts_list_of_another_length(clean_env, no_jax_distributed, tmp_path):
    clean_env.setenv("REDCO_HOSTS", "localhost,localhost,localhost")
    assert deployer_error(tmp_path, n_processes=2, host0_address="127.0.0.1", host0_port=1234,
                          process_id=1).startswith(
        "REDCO_HOSTS names 3 hosts (localhost,localhost,localhost) but n_processes=2")


@pytest.mark.parametrize("env, kwargs, message", [
    (dict(REDCO_ENV, REDCO_PROCESS_ID="2"), {},
     "process_id=2 but n_processes=2 (ip launcher): ids run from 0 to 1, one per process. "
     "Is the process count the same on every host?"),
    ({}, dict(n_processes=2, host0_address="127.0.0.1", host0_port=1234, process_id=-1),
     "process_id=-1 but n_processes=2"),
    (dict(REDCO_ENV, REDCO_N_PROCESSES="4"), dict(n_processes=2),
     "Deployer(n_processes=2) disagrees with REDCO_N_PROCESSES=4 in the environment"),
    (dict(REDCO_N_PROCESSES="2"), {},
     "n_processes=2 needs ['host0_address', 'host0_port', 'process_id'] as well (Deployer "
     "arguments, or REDCO_HOST0_ADDRESS, REDCO_HOST0_PORT, REDCO_PROCESS_ID)"),
    (dict(REDCO_ENV, REDCO_HOST0_PORT="http"), {}, "REDCO_HOST0_PORT='http' is not an integer"),
    (dict(REDCO_ENV, REDCO_HOST0_PORT="70000"), {}, "host0_port=70000 is not a TCP port"),
], ids=["id-too-big", "id-negative", "args-vs-env", "env-incomplete", "port-text", "port-range"])
def test_ip_mistakes(clean_env, no_jax_distributed, tmp_path, env, kwargs, message):
    for key, value in env.items():
        clean_env.setenv(key, value)
    assert message in deployer_error(tmp_path, **kwargs)
