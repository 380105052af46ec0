"""Starting redco loads every installed plugin; with every plugin distribution of this repository
installed (the plugins env installs them all), none may import torch, which takes seconds on a
GPU machine (CUDA torch) before every run's first step. tensorboardX, which redco-tensorboard
used before, imports torch whenever it is installed."""
import glob
import json
import os
import subprocess
import sys

import tomllib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
LOAD_ALL = ("import json, sys\nfrom redco import plugins\nfrom redco.protocols import REQUIRED\n"
            "for kind in REQUIRED:\n    plugins.registry(kind)\n"
            "print(json.dumps({'loaded': sorted(plugins.plugin_sources), "
            "'torch': 'torch' in sys.modules}))\n")


def repository_plugins() -> dict[str, str]:
    """``{entry-point name: plugin directory}`` of every plugin distribution under plugins/."""
    found = {}
    for path in glob.glob(os.path.join(REPO, "plugins", "*", "pyproject.toml")):
        with open(path, "rb") as f:
            entry_points = tomllib.load(f)["project"]["entry-points"]["redco"]
        found.update({name: os.path.relpath(os.path.dirname(path), REPO) for name in entry_points})
    return found


def test_loading_every_plugin_imports_no_torch(tmp_path):
    fake = tmp_path / "torch"  # a torch that is "installed": importing it is what we look for
    fake.mkdir()
    (fake / "__init__.py").write_text("Tensor = object\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    env.pop("REDCO_PLUGINS", None)
    env.pop("REDCO_DISABLE_PLUGIN_AUTOLOAD", None)
    out = subprocess.run([sys.executable, "-c", LOAD_ALL], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    expected = repository_plugins()
    missing = sorted(f"{name} ({where})" for name, where in expected.items()
                     if name not in result["loaded"])
    assert not missing, (f"plugins not loaded, so not checked: {missing}. Install them into this "
                         f"env (tox.ini's plugins deps); a failed load is warned on stderr:\n"
                         f"{out.stderr}")
    assert not result["torch"], f"a plugin imported torch at start (loaded: {result['loaded']})"
