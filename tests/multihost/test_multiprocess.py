"""Several processes on 127.0.0.1, joined by ``jax.distributed`` through the ``ip`` launcher,
train exactly like one process with the same total number of devices."""
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

WORKER = os.path.join(os.path.dirname(__file__), "worker.py")
TOTAL_DEVICES = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(n_processes: int, workdir: str, timeout: int = 600) -> list[dict]:
    os.makedirs(workdir, exist_ok=True)
    port, per_process = free_port(), TOTAL_DEVICES // n_processes
    env = dict(os.environ, HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, WORKER, str(i), str(n_processes), str(port),
                               str(per_process), workdir], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for i in range(n_processes)]
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"process {i} failed:\n{out[-4000:]}"
    results = []
    for i in range(n_processes):
        with open(os.path.join(workdir, f"result_{i}.json")) as f:
            results.append(json.load(f))
    return results


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("single"))
    return launch(1, workdir)[0], np.load(os.path.join(workdir, "params.npz"))


@pytest.mark.parametrize("n_processes", [2, 4])
def test_processes_train_like_one_process(n_processes, single, tmp_path):
    reference, reference_params = single
    results = launch(n_processes, str(tmp_path))
    for r in results:
        assert (r["process_count"], r["devices"]) == (n_processes, TOTAL_DEVICES)
        assert r["local_devices"] == TOTAL_DEVICES // n_processes
        assert len(r["losses"]) == len(reference["losses"]) == 8
        np.testing.assert_allclose(r["losses"], reference["losses"], rtol=1e-5, atol=1e-5)
        assert r["preds"] == reference["preds"]  # gathered once, in order, on every process
    assert results[0]["ckpts"] == ["step_8"]  # written once
    params = np.load(os.path.join(str(tmp_path), "params.npz"))
    assert sorted(params) == sorted(reference_params)
    for name in params:
        np.testing.assert_allclose(params[name], reference_params[name], rtol=1e-5, atol=1e-5)


def test_a_busy_port_is_refused_with_a_clear_error(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = ("from redco import Deployer\n"
                f"Deployer(jax_seed=0, n_processes=2, host0_address='127.0.0.1', host0_port={port},"
                f" process_id=0, workdir={str(tmp_path)!r})")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode != 0
    assert f"host0_port={port} is already in use on this host" in out.stderr


@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_process_stops_the_others_quickly_naming_it(victim, tmp_path):
    """SIGKILL one process at step 3: the survivor exits non-zero within 60 s, saying which
    process was lost."""
    port, workdir = free_port(), str(tmp_path)
    env = dict(os.environ, HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen(
        [sys.executable, WORKER, str(i), "2", str(port), "4", workdir], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
        env=dict(env, REDCO_TEST_KILL_AT_STEP="3") if i == victim else env) for i in range(2)]
    survivor = procs[1 - victim]
    procs[victim].wait(timeout=600)
    killed_at = time.monotonic()
    out = survivor.communicate(timeout=120)[0]
    assert procs[victim].returncode == -9
    assert survivor.returncode != 0
    assert time.monotonic() - killed_at < 60
    if victim == 1:
        assert "Lost process 1 of 2" in out, out[-3000:]
    else:  # jax's own agent aborts first, naming the coordination service (process 0)
        assert ("Lost another process (or the coordinator" in out
                or "Failed to send RPC to coordination service" in out), out[-3000:]
