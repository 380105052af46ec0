"""Each run's ``log.txt`` holds that run's lines only, also when several runs (Deployers) follow
one another in one process, as in a sweep or a notebook."""
import os

from redco import Deployer


def lines(workdir: str) -> str:
    with open(os.path.join(workdir, "log.txt")) as f:
        return f.read()


def test_a_later_run_in_the_same_process_writes_its_own_log_only(tmp_path):
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    one = Deployer(jax_seed=0, workdir=first, verbose=False)
    one.log_info("a line of the first run")
    two = Deployer(jax_seed=0, workdir=second, verbose=False)
    two.log_info("a line of the second run")
    Deployer(jax_seed=0, workdir=None, verbose=False).log_info("a line of a run with no workdir")
    assert "first run" in lines(first) and "first run" not in lines(second)
    assert "second run" in lines(second) and "second run" not in lines(first)
    assert "no workdir" not in lines(first) + lines(second)
