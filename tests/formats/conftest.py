"""Every test here runs for each checkpoint format: ``fmt`` is ``orbax`` (redco's built-in),
``safetensors`` (redco-safetensors) and ``msgpack`` (redco-msgpack) in turn.

8 simulated CPU devices (set before jax is imported), exact matmuls and offline hubs, as in
tests/core, whose helpers (helpers.py, ckpt_helpers.py, kill_worker.py) these tests share."""
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["HF_HUB_OFFLINE"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "core"))

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

FORMATS = ["orbax", "safetensors", "msgpack"]


@pytest.fixture(scope="module", params=FORMATS)
def fmt(request) -> str:
    return request.param
