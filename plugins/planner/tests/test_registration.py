"""The planner is a plugin: found through the ``redco`` entry-point group, and when it is absent
``n_model_shards="auto"`` and ``redco plan`` fail saying what is missing."""
import os
import subprocess
import sys

import pytest

from redco import plugins
from redco.cli import main
from redco.protocols import LayoutPlanner
from redco_planner import AutoLayoutPlanner


@pytest.fixture
def planner_blocked():
    """The planner unregistered and blocked, as if redco-planner were not installed."""
    plugins.pm.set_blocked("planner")
    yield
    plugins.pm.unblock("planner")
    plugins.load_entrypoint_plugins()


def test_registered_from_its_distribution(capsys):
    assert isinstance(plugins.lookup("layout_planners", "auto"), AutoLayoutPlanner)
    assert issubclass(AutoLayoutPlanner, LayoutPlanner)
    assert plugins.plugin_sources["planner"].startswith("redco-planner ")
    commands = plugins.registry("commands")
    assert {"plan", "rules"} <= set(commands)
    with pytest.raises(SystemExit) as info:
        main(["plan", "--help"])
    assert info.value.code == 0
    assert "--device_memory" in capsys.readouterr().out


def test_without_the_planner_auto_and_plan_say_what_is_missing(planner_blocked, workdir, capsys,
                                                             fit_auto):
    assert not plugins.pm.has_plugin("planner")
    with pytest.raises(ValueError, match=r"No layout planners named 'auto'"):
        plugins.lookup("layout_planners", "auto")
    assert "plan" not in plugins.registry("commands")
    with pytest.raises(SystemExit) as info:
        main(["plan", "--help"])
    assert info.value.code == 2  # not a command
    assert "invalid choice: 'plan'" in capsys.readouterr().err

    with pytest.raises(ValueError, match=r"No layout planners named 'auto'"):
        fit_auto(workdir, "1GB", n_examples=8)


def test_unblocked_again_after_the_fixture():
    assert isinstance(plugins.lookup("layout_planners", "auto"), AutoLayoutPlanner)


def test_a_run_with_integer_n_model_shards_never_imports_the_planner(tmp_path):
    """Loading the plugin imports only its registration and command-line classes."""
    script = f'''
import sys
import numpy as np, optax, jax.numpy as jnp
from redco import Deployer, Trainer
deployer = Deployer(jax_seed=0, n_model_shards=2, workdir={str(tmp_path)!r}, verbose=False)
params = {{"w": jnp.zeros((8, 4))}}
loss = lambda rng, state, params, batch, is_training: jnp.mean(
    (batch["x"] @ params["w"] - batch["y"]) ** 2)
collate = lambda rows: {{k: np.stack([r[k] for r in rows]) for k in rows[0]}}
rows = [{{"x": np.ones(8, np.float32), "y": np.zeros(4, np.float32)}}] * 16
Trainer(deployer, collate, lambda p, x: x, loss, params, optax.sgd(0.1)).fit(
    rows, per_device_batch_size=1, n_epochs=1)
print(sorted(m for m in sys.modules if m.startswith("redco_planner")))
'''
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "['redco_planner', 'redco_planner.commands']"
