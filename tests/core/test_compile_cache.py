"""The persistent compile cache: a second start of the same training loads its train step from
the cache instead of compiling it, says so in log.txt, and trains to the same bits; it lives in
``<workdir>/compile_cache`` by default and ``REDCO_COMPILE_CACHE`` moves it or turns it off."""
import os
import re
import subprocess
import sys

import numpy as np
import optax
from ckpt_helpers import TIMEOUT
from helpers import mlp_apply, mlp_collate, mlp_examples, mlp_init, mlp_loss

from redco import Deployer, Trainer

WORKER = os.path.join(os.path.dirname(__file__), "kill_worker.py")


def train(workdir: str, cache: str) -> str:
    """kill_worker's training (no kill) in a fresh process; the line log.txt gives the first
    step."""
    env = {**os.environ, "REDCO_COMPILE_CACHE": cache}
    done = subprocess.run([sys.executable, WORKER, workdir], env=env, capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(os.path.join(workdir, "log.txt")) as f:
        return re.search(r"First train step traced and compiled in [\d.]+ s \((.*)\)\.",
                         f.read()).group(1)


def test_a_second_start_loads_the_step_from_the_cache_and_trains_the_same(tmp_path):
    cache = str(tmp_path / "cache")
    first = train(str(tmp_path / "a"), cache)
    assert first == f"compiled, and kept in the compile cache {cache}", first
    assert os.listdir(cache)
    second = train(str(tmp_path / "b"), cache)
    assert second == f"loaded from the compile cache {cache}", second
    a, b = np.load(tmp_path / "a" / "final.npz"), np.load(tmp_path / "b" / "final.npz")
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])


def test_redco_compile_cache_off_keeps_nothing_and_says_so(workdir, monkeypatch):
    """In the test process (a third worker process cost ~4 CPU s for what one fit here shows)."""
    monkeypatch.setenv("REDCO_COMPILE_CACHE", "off")
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=workdir, verbose=False)
    assert deployer.compile_cache_dir is None
    Trainer(deployer, mlp_collate, mlp_apply, mlp_loss, mlp_init(), optax.sgd(0.1)).fit(
        mlp_examples(32), 2, n_epochs=1)
    with open(os.path.join(workdir, "log.txt")) as f:
        assert re.search(r"First train step traced and compiled in [\d.]+ s \(compile cache "
                         r"off\)\.", f.read())
    assert not os.path.exists(os.path.join(workdir, "compile_cache"))


def test_by_default_the_cache_is_in_the_workdir(workdir, monkeypatch):
    monkeypatch.delenv("REDCO_COMPILE_CACHE", raising=False)
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=workdir, verbose=False)
    assert deployer.compile_cache_dir == os.path.join(workdir, "compile_cache")
    Trainer(deployer, mlp_collate, mlp_apply, mlp_loss, mlp_init(), optax.sgd(0.1)).fit(
        mlp_examples(32), 2, n_epochs=1)
    assert any(name.startswith("jit_") for name in os.listdir(deployer.compile_cache_dir))
    assert Deployer(jax_seed=0, workdir=workdir, compile_cache_dir=False,
                    verbose=False).compile_cache_dir is None
    assert Deployer(jax_seed=0, workdir=None, verbose=False).compile_cache_dir is None
