"""The fixtures the launcher tests share; they and the helpers are in ``multihost_helpers.py``
(imported by the launcher plugins' tests as well)."""
import pytest
from multihost_helpers import clean_env, no_jax_distributed, reference_run  # noqa: F401 (fixtures)


@pytest.fixture(scope="session")
def reference():
    """One process with all 8 devices: what every multi-process run must reproduce."""
    return reference_run()
