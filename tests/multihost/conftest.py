"""Shared by the launcher tests: the single-process reference run of ``worker.py`` and the check
that a multi-process run trained exactly like it."""
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "worker.py")
TOTAL_DEVICES = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(**extra) -> dict:
    """The environment of a worker: CPU only, offline, no SLURM or REDCO_* variables of ours."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "REDCO_N_", "REDCO_HOST", "REDCO_PROCESS"))}
    return dict(env, HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu", **extra)


def read_results(workdir: str, n_processes: int) -> list[dict]:
    results = []
    for i in range(n_processes):
        with open(os.path.join(workdir, f"result_{i}.json")) as f:
            results.append(json.load(f))
    return results


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """One process with all 8 devices: what every multi-process run must reproduce."""
    workdir = str(tmp_path_factory.mktemp("reference"))
    out = subprocess.run([sys.executable, WORKER, "0", "1", "0", str(TOTAL_DEVICES), workdir],
                         env=worker_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return read_results(workdir, 1)[0], dict(np.load(os.path.join(workdir, "params.npz")))


def assert_trains_like_reference(workdir: str, n_processes: int, launcher: str, reference):
    """Every process saw all devices, the losses, predictions and final params match one
    process to 1e-5, and the checkpoint was written once."""
    ref, ref_params = reference
    results = read_results(workdir, n_processes)
    for r in results:
        assert r["launcher"] == launcher
        assert (r["process_count"], r["devices"]) == (n_processes, TOTAL_DEVICES)
        assert r["local_devices"] == TOTAL_DEVICES // n_processes
        assert len(r["losses"]) == len(ref["losses"]) == 8
        np.testing.assert_allclose(r["losses"], ref["losses"], rtol=1e-5, atol=1e-5)
        assert r["preds"] == ref["preds"]
    assert results[0]["ckpts"] == ["step_8"]
    params = np.load(os.path.join(workdir, "params.npz"))
    assert sorted(params) == sorted(ref_params)
    for name in params:
        np.testing.assert_allclose(params[name], ref_params[name], rtol=1e-5, atol=1e-5)
