"""8 simulated CPU devices (set before jax is imported), offline hubs, and the launcher tests'
shared helpers and fixtures from ``tests/multihost/multihost_helpers.py`` (the worker, the
one-process reference run, an environment without launcher variables, a ``jax.distributed`` that
must not be reached, the 2-process run under ``redco launch --launcher ip``). These tests run in
the repository: the worker (``tests/multihost/worker.py``) trains the tiny LM of
``tests/core/helpers.py``."""
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["HF_HUB_OFFLINE"] = "1"

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..",
                                "tests", "multihost"))

from multihost_helpers import (  # noqa: E402, F401 (fixtures)
    clean_env,
    no_jax_distributed,
    reference,
    two_processes,
)
