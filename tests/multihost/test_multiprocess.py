"""Several processes on 127.0.0.1, joined by ``jax.distributed`` through the ``ip`` launcher,
train exactly like one process with the same total number of devices."""
import json
import os
import socket
import subprocess
import sys

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
