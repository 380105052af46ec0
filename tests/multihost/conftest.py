"""The fixtures the launcher tests share; they and the helpers are in ``multihost_helpers.py``
(imported by the launcher plugins' tests as well); and GRPO's 2-process run, made once for the
tests that compare with it."""
import pytest
from multihost_helpers import (  # noqa: F401 (fixtures)
    clean_env,
    no_jax_distributed,
    reference,
    two_processes,
)


@pytest.fixture(scope="session")
def grpo_two_processes(tmp_path_factory):
    """A folder holding ``test_grpo_processes``' task and its GRPO run on 2 processes under
    ``redco launch`` (in ``two``)."""
    from test_grpo_processes import launched_on_two_processes, write_task
    root = tmp_path_factory.mktemp("grpo")
    write_task(root)
    launched_on_two_processes(root)
    return root
