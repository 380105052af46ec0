"""8 simulated CPU devices (set before jax is imported), offline hubs; the launcher tests' shared
helpers and fixtures from ``tests/multihost/multihost_helpers.py`` (the worker, the one-process
reference run, an uninterrupted 2-process run, an environment without launcher variables); and
``slurm``, a real one-node SLURM cluster on this machine (``slurm.sh``) for the tests that submit
jobs.

These tests run in the repository: the worker (``tests/multihost/worker.py``) trains the tiny LM of
``tests/core/helpers.py``.
"""
import os
import subprocess
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "tests", "multihost"))

from multihost_helpers import (  # noqa: E402, F401 (fixtures)
    clean_env,
    no_jax_distributed,
    reference,
    two_processes,
    worker_env,
)

SLURM_SH = os.path.join(HERE, "slurm.sh")
SLURM_DIR = os.environ.get("REDCO_SLURM_DIR", "/tmp/redco-slurm")


def slurm_sh(action: str) -> None:
    out = subprocess.run(["bash", SLURM_SH, action], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        why = out.stderr.strip() or out.stdout.strip()
        hint = "" if "REDCO_SKIP_SLURM" in why else "\n(REDCO_SKIP_SLURM=1 skips the SLURM tests)"
        pytest.fail(f"plugins/slurm/tests/slurm.sh {action} failed ({out.returncode}): {why}{hint}",
                    pytrace=False)


@pytest.fixture(scope="module")
def slurm():
    """Install SLURM if missing, start munged, slurmctld and slurmd; stop them afterwards.
    Yields the environment a SLURM client needs (``SLURM_CONF``). If SLURM cannot be installed
    or started the tests FAIL, saying why; ``REDCO_SKIP_SLURM=1`` skips them instead."""
    if os.environ.get("REDCO_SKIP_SLURM") == "1":
        pytest.skip("REDCO_SKIP_SLURM=1")
    slurm_sh("install")
    slurm_sh("start")
    yield worker_env(SLURM_CONF=os.path.join(SLURM_DIR, "slurm.conf"))
    slurm_sh("stop")
