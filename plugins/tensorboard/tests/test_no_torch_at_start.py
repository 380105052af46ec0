"""Starting redco loads every installed plugin (all of this repository's, in this env); none may
import torch, which takes seconds on a GPU machine (CUDA torch) before every run's first step.
tensorboardX, which redco-tensorboard used before, imports torch whenever it is installed."""
import os
import subprocess
import sys


def test_loading_every_plugin_imports_no_torch(tmp_path):
    fake = tmp_path / "torch"  # a torch that is "installed": importing it is what we look for
    fake.mkdir()
    (fake / "__init__.py").write_text("Tensor = object\n")
    code = ("import sys\nfrom redco import plugins\nfrom redco.protocols import REQUIRED\n"
            "names = {kind: sorted(plugins.registry(kind)) for kind in REQUIRED}\n"
            "assert 'tensorboard' in names['loggers'] and 'wandb' in names['loggers'], names\n"
            "print('torch' in sys.modules)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", "a plugin imported torch at start"
