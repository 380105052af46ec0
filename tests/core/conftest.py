"""8 simulated CPU devices (set before jax is imported), exact matmuls, offline hubs."""
import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["HF_HUB_OFFLINE"] = "1"

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture
def workdir(tmp_path):
    return str(tmp_path / "workdir")


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    """The kill tests' uninterrupted orbax run, one for the session (ckpt_helpers.Uninterrupted)."""
    from ckpt_helpers import Uninterrupted
    return Uninterrupted(str(tmp_path_factory.mktemp("uninterrupted") / "full"))
