"""Installed as users install it: wheels built from ``core/`` (the default plugins inside) and
``zoo/maml``, ``pip install --find-links dist redco-zoo-maml`` into a fresh virtual environment;
then the zoo pipeline is listed, ``redco new --template maml`` gives a project whose tests pass,
and a project from the ``plugin`` template, once installed, is listed and its rule set used."""
import os
import subprocess
import sys
import venv

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(cmd, cwd=None) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    out = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=1200)
    assert out.returncode == 0, f"{cmd} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """``(root, python, redco)`` of a new venv holding only what pip installed from wheels."""
    root = tmp_path_factory.mktemp("users")
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", root / "dist",
         os.path.join(REPO, "core"), os.path.join(REPO, "zoo", "maml")])
    venv.create(root / "venv", with_pip=True)
    python, redco = root / "venv" / "bin" / "python", root / "venv" / "bin" / "redco"
    run([python, "-m", "pip", "install", "-q", "--find-links", root / "dist", "redco-zoo-maml",
         "pytest"])
    return root, python, redco


def test_a_zoo_package_brings_its_pipeline_and_template(fresh):
    root, python, redco = fresh
    assert "redco 0.5.0" in run([python, "-m", "pip", "list", "--format=freeze"]).replace("==", " ")
    assert any(line.startswith("maml ") for line in run([redco, "zoo", "list"]).splitlines())
    run([redco, "new", "--template", "maml", "proj"], cwd=root)
    run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=root / "proj")


def test_a_plugin_project_once_installed_is_listed_and_used(fresh):
    root, python, redco = fresh
    run([redco, "new", "--template", "plugin", "myplug"], cwd=root)
    run([python, "-m", "pip", "install", "-q", root / "myplug"])
    plugins = {line.split()[0]: line for line in run([redco, "plugins"]).splitlines()}
    assert "register_sharding_rules" in plugins["myplug"]
    run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=root / "myplug")
