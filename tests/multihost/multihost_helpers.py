"""What every launcher test shares: the worker (``worker.py``), the single-process reference run
of it, the check that a multi-process run trained exactly like it, ``redco`` run in-process, and
fixtures for the reference run, an uninterrupted 2-process run of the worker, an environment
without launcher variables and a ``jax.distributed`` that must not be reached (each conftest
imports them to offer them).

A module of its own (not ``conftest.py``) because the launcher plugins' tests (``plugins/ip/tests``,
``plugins/slurm/tests``, ``plugins/xmanager/tests``) import it too, and pytest gives every
``conftest.py`` outside a package the same module name, so ``from conftest import ...`` would get
whichever conftest was loaded last when several test folders run together. The reference run is
made once per pytest process, whichever folder asks first, and so is the 2-process run.
"""
import atexit
import functools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
import pytest

from redco import Deployer
from redco.cli import main as redco

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "worker.py")
TOTAL_DEVICES = 8


def wait_until(condition, what: str, timeout_s: float, every_s: float = 0.05) -> None:
    """Return once ``condition()`` is true; fail naming ``what`` did not happen within
    ``timeout_s`` (a deadline for a state another process reaches, never a guessed pause)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting until {what}"
        time.sleep(every_s)


def start_processes(argv, workdir: str, n: int = 2) -> tuple[list[subprocess.Popen], list[str]]:
    """``n`` processes ``argv(i, port)`` of one run (``port``: process 0's, free), each logging
    to a file next to ``workdir`` (made if missing); the processes and their log files."""
    os.makedirs(workdir, exist_ok=True)
    port, procs, logs = free_port(), [], []
    for i in range(n):
        logs.append(os.path.join(os.path.dirname(workdir),
                                 f"{os.path.basename(workdir)}.{port}.{i}.log"))
        with open(logs[-1], "w") as out:
            procs.append(subprocess.Popen(argv(i, port), env=worker_env(), stdout=out,
                                          stderr=subprocess.STDOUT))
    return procs, logs


def run_processes(argv, workdir: str, n: int = 2, victim: int | None = None,
                  timeout_s: float = 240) -> tuple[list, str]:
    """Run ``start_processes(argv, workdir, n)`` to their ends: their exit statuses ("hung" past
    ``timeout_s``) and the ends of their logs, less XLA's INFO lines. With ``victim``: once that
    process ended (killed), the others are SIGKILLed, as a job scheduler ends the rest of a job."""
    procs, logs = start_processes(argv, workdir, n)
    try:
        if victim is not None:
            procs[victim].wait(timeout=timeout_s)
            for p in procs:
                p.kill()
        codes = [p.wait(timeout=timeout_s) for p in procs]
    except subprocess.TimeoutExpired:
        codes = ["hung"]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    text = "\n".join(f"--- process {i}:\n" + re.sub(r"(?m)^I\d{4} .*\n", "", open(log).read())[-2500:]
                     for i, log in enumerate(logs))
    return codes, text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Prefixes of the variables launchers read: a test must not inherit them from its machine.
LAUNCHER_VARS = ("SLURM_", "REDCO_N_", "REDCO_HOST", "REDCO_PROCESS")


def simulated_devices(n: int) -> str:
    """XLA_FLAGS of this run (tox.ini's compile flags) with ``n`` simulated CPU devices."""
    return os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"


def worker_env(**extra) -> dict:
    """The environment of a worker: CPU only, offline, no SLURM or REDCO_* variables of ours."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARS)}
    return dict(env, HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu", **extra)


@pytest.fixture
def clean_env(monkeypatch):
    """No SLURM or REDCO_* variables from the machine running the tests."""
    for key in list(os.environ):
        if key.startswith(LAUNCHER_VARS):
            monkeypatch.delenv(key)
    return monkeypatch


@pytest.fixture
def no_jax_distributed(monkeypatch):
    """Launchers must refuse before they reach jax.distributed.initialize."""
    def reached(**kwargs):
        raise AssertionError(f"jax.distributed.initialize was reached with {kwargs}")
    monkeypatch.setattr(jax.distributed, "initialize", reached)


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """``redco ARGV...`` in this process: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exit_:
        redco(list(argv))
    out = capsys.readouterr()
    return exit_.value.code, out.out, out.err


def deployer_error(tmp_path, **kwargs) -> str:
    """The message of the error ``Deployer(**kwargs)`` raises (it must raise)."""
    with pytest.raises((ValueError, RuntimeError)) as error:
        Deployer(jax_seed=0, workdir=str(tmp_path), loggers=(), verbose=False, **kwargs)
    return str(error.value)


def read_results(workdir: str, n_processes: int) -> list[dict]:
    results = []
    for i in range(n_processes):
        with open(os.path.join(workdir, f"result_{i}.json")) as f:
            results.append(json.load(f))
    return results


@functools.cache
def reference_run() -> tuple[dict, dict]:
    """One process with all 8 devices: what every multi-process run must reproduce. Returns the
    worker's result and its final params (name -> array)."""
    workdir = tempfile.mkdtemp(prefix="redco-reference-")
    try:
        out = subprocess.run([sys.executable, WORKER, "0", "1", "0", str(TOTAL_DEVICES), workdir],
                             env=worker_env(), capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        return read_results(workdir, 1)[0], dict(np.load(os.path.join(workdir, "params.npz")))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def reference():
    """One process with all 8 devices: what every multi-process run must reproduce."""
    return reference_run()


def launch(n_processes: int, workdir: str, **env) -> None:
    """``n_processes`` workers with explicit ip arguments, 8 devices in all, to their ends."""
    port, per_process = free_port(), TOTAL_DEVICES // n_processes
    procs = [subprocess.Popen([sys.executable, WORKER, str(i), str(n_processes), str(port),
                               str(per_process), workdir], env=worker_env(**env),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(n_processes)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"process {i} failed:\n{out[-4000:]}"


@functools.cache
def two_process_run() -> str:
    """The folder of an uninterrupted run of the worker on 2 processes (4 devices each), kept
    until pytest exits: compared with one process, and what every stopped and resumed 2-process
    run of it (``launch``: explicit ip arguments) must end like, bit for bit. Started by
    ``redco launch --launcher ip --run`` (the ``ip`` plugin; the second host named by this
    machine's hostname), the worker detecting its launcher; the launcher's stdout is in
    ``<folder>/launch_stdout.txt``. Made once per pytest process, like the reference."""
    workdir = tempfile.mkdtemp(prefix="redco-two-processes-")
    atexit.register(shutil.rmtree, workdir, ignore_errors=True)
    out = subprocess.run(
        [sys.executable, "-m", "redco.cli", "launch", "--launcher", "ip", "--hosts",
         f"127.0.0.1,{socket.gethostname()}", "--port", str(free_port()), "--run", "--",
         sys.executable, WORKER, "detect", "4", workdir],
        env=worker_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    with open(os.path.join(workdir, "launch_stdout.txt"), "w") as f:
        f.write(out.stdout)
    return workdir


@pytest.fixture(scope="session")
def two_processes() -> str:
    """The folder of an uninterrupted 2-process run (``two_process_run``)."""
    return two_process_run()


def assert_trains_like_reference(workdir: str, n_processes: int, launcher: str, reference,
                                 n_context_shards: int = 1):
    """Every process saw all devices and read its share of the examples (processes splitting
    the same sequences read the same ones), the losses, predictions and final params match one
    process to 1e-5, and the checkpoint was written once."""
    ref, ref_params = reference
    results = read_results(workdir, n_processes)
    for r in results:
        assert r["launcher"] == launcher
        assert (r["process_count"], r["devices"]) == (n_processes, TOTAL_DEVICES)
        assert r["local_devices"] == TOTAL_DEVICES // n_processes
        assert len(r["losses"]) == len(ref["losses"]) == 8
        assert r["examples_read"] == 2 * 32 * n_context_shards // n_processes  # of 2 epochs
        np.testing.assert_allclose(r["losses"], ref["losses"], rtol=1e-5, atol=1e-5)
        assert r["preds"] == ref["preds"]
    assert results[0]["ckpts"] == ["step_8"]
    params = np.load(os.path.join(workdir, "params.npz"))
    assert sorted(params) == sorted(ref_params)
    for name in params:
        np.testing.assert_allclose(params[name], ref_params[name], rtol=1e-5, atol=1e-5)
