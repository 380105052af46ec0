"""8 simulated CPU devices (set before jax is imported), exact matmuls, offline hubs; ``tests/`` on
the path for the helpers shared with other folders (``post_training_task``, ``readme_blocks``)."""
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["HF_HUB_OFFLINE"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture
def workdir(tmp_path):
    return str(tmp_path / "workdir")
