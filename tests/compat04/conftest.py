"""Scripts written for Redco 0.4.x, run against this package: 8 simulated CPU devices (set
before jax is imported), offline hubs, each test in its own working directory."""
import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(autouse=True)
def in_tmp_dir(tmp_path, monkeypatch):
    """0.4.x scripts write ``./workdir`` relative to where they run: run each in its own dir."""
    monkeypatch.chdir(tmp_path)
    return tmp_path
