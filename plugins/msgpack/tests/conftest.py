"""8 simulated CPU devices (set before jax is imported), exact matmuls."""
import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
