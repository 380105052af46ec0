"""Every template registered by an installed package (redco's own and every zoo package's)
becomes a named project through ``redco new`` and that project's own tests pass out of the box,
run as a user would run them: the project README's block ``install-and-test`` (``pip install -e
".[test]"``, ``pytest``, and whatever else it lists), verbatim in the new directory, with this
environment's ``pip`` and ``pytest`` (seq2seq's steps run in tests/install instead, in a fresh venv
from the wheels). Each zoo pipeline has a template of the same name."""
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from redco.cli import main

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from readme_blocks import block  # noqa: E402

from redco.plugins import registry

TEMPLATES = registry("templates")
THREE = {"collate_fn", "loss_fn", "pred_fn"}
ZOO = Path(__file__).resolve().parents[2] / "zoo"
IN_REPO = sorted(d.name for d in ZOO.iterdir()  # zoo/NAME/redco_zoo_NAME/{pipeline.py,template}
                 if (d / f"redco_zoo_{d.name}" / "pipeline.py").is_file()
                 and (d / f"redco_zoo_{d.name}" / "template" / "main.py").is_file())
NEEDS_INSTALL = {"plugin"}  # found through its entry point: tests/install installs and runs it
# tests/install runs this project's block install-and-test verbatim in a fresh venv made from
# the wheels (README.md's install lines), so here only what `redco new` writes is checked
RUN_BY_INSTALL = {"seq2seq"}


def test_every_zoo_pipeline_has_a_template():
    assert {"minimal", "plugin"} <= set(TEMPLATES)
    assert set(registry("zoo_pipelines")) <= set(TEMPLATES), sorted(TEMPLATES)


def test_every_zoo_package_registers_its_pipeline_and_template():
    """A zoo package that fails to load (its plugin skipped with a warning) would otherwise drop
    out of these tests silently."""
    assert len(IN_REPO) >= 9, IN_REPO
    unregistered = set(IN_REPO) - (set(registry("zoo_pipelines")) & set(TEMPLATES))
    assert not unregistered, (f"zoo packages {sorted(unregistered)} register no pipeline and template "
                              "of their name: pip install -e zoo/NAME, and see the warnings of "
                              "plugins that failed to load.")


def test_loading_plugins_imports_no_zoo_pipeline():
    """Each zoo package registers through its small ``plugin.py``: a process that loads redco's
    plugins (every ``redco`` call, every ``Deployer``) lists every pipeline and template but
    imports no pipeline, nor the models and flax.nnx behind them, until it runs one."""
    code = ("import sys; from redco import plugins; print(sorted(plugins.registry('zoo_pipelines')));"
            " print(sorted(m for m in sys.modules if m.endswith('.pipeline') or m in "
            "('redco_zoo_models', 'flax.nnx')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    listed, imported = done.stdout.splitlines()[-2:]
    assert set(IN_REPO) <= set(ast.literal_eval(listed)), listed
    assert ast.literal_eval(imported) == [], (f"loading plugins imported {imported}: a zoo package's "
                                              "entry point must name its plugin module, which "
                                              "registers redco.plugins.DeferredCommand")


def test_zoo_templates_import_their_pipelines_functions():
    """A template's main.py imports the three functions from its package's pipeline.py (the code
    `redco zoo run NAME` runs) rather than holding a copy that could drift from it."""
    copies = {name: found for name in IN_REPO
              if (found := sorted(THREE & defined_in(ZOO / name / f"redco_zoo_{name}" / "template"
                                                     / "main.py")))}
    assert not copies, (f"these templates' main.py define {copies} themselves: import them from "
                        "the package's pipeline.py instead")


def test_the_templates_readme_lists_every_template():
    readme = os.path.join(os.path.dirname(__file__), "..", "..", "templates", "README.md")
    with open(readme) as f:
        text = f.read()
    assert not [name for name in TEMPLATES if f"| `{name}` |" not in text], sorted(TEMPLATES)


def defined_in(path: Path) -> set[str]:
    """The names of the functions and classes defined at the top level of the file at ``path``."""
    return {node.name for node in ast.parse(path.read_text()).body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


@pytest.mark.parametrize("name", sorted(set(TEMPLATES) - NEEDS_INSTALL))
def test_new_project_passes_its_own_tests(name, tmp_path, capsys):
    dest = tmp_path / f"my-{name}"
    main(["new", "--template", name, str(dest)])
    assert f"wrote {dest}" in capsys.readouterr().out
    assert {"README.md", "main.py", "pyproject.toml", "tests"} <= set(os.listdir(dest))
    assert f'name = "my_{name}"' in (dest / "pyproject.toml").read_text()
    assert not [p for p in dest.rglob("*") if p.is_file() and "{{" in p.read_text()]
    if name in RUN_BY_INSTALL:
        return
    env = dict(os.environ)  # the project's tests add their own device count to XLA_FLAGS
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env["PATH"]])  # pip, pytest
    # pip builds the project with this environment's setuptools (tox.ini) instead of installing
    # one into a fresh build environment per project: 3.3 -> 1.7 CPU s and 7.5-10.4 -> 3.6-6.1 s
    # a project. A fresh user's build, isolation included, is tests/install's seq2seq project.
    env["PIP_NO_BUILD_ISOLATION"] = "0"  # (pip reads this variable inverted: "0" = no isolation)
    steps = block("install-and-test", str(dest / "README.md"))
    done = subprocess.run(["bash", "-ec", steps], cwd=dest, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout
