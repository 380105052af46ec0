"""The fixtures the launcher tests share; they and the helpers are in ``multihost_helpers.py``
(imported by the launcher plugins' tests as well)."""
from multihost_helpers import clean_env, no_jax_distributed, reference  # noqa: F401 (fixtures)
