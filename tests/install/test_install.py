"""The README's install lines, run verbatim as a user runs them, in one fresh virtual environment.

A copy of this working tree as a clone of it would be (no ``.git``, nothing ``.gitignore`` names)
builds the wheels of every distribution into its ``dist/`` with the documented command; then the
card's lines run in a shell whose PATH starts with the new venv (``pip``, ``redco``, ``pytest``
and ``python`` are its own; this tox env's are off the PATH): ``pip install --find-links dist
redco-zoo-maml`` and ``redco list zoo`` shows maml; ``redco new --template seq2seq myproj`` and
then the generated project's README steps, read out of its block ``install-and-test`` so that a drifting
README fails here, including its own tests; ``pip install --find-links dist redco-slurm`` adds
``slurm`` to ``redco launch --launcher``. The ``plugin`` template's project, installed as its
README says, is listed by ``redco list plugins`` and its tests use its rule set. Each line is also
looked up in README.md's block ``install``, so the lines tested are the lines documented. The
README's main job (block ``main-job``) runs verbatim in the same copy."""
import glob
import os
import re
import shutil
import subprocess
import sys
import venv

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from readme_blocks import block  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = "python tools/build_dists.py"
MAML = "pip install --find-links dist redco-zoo-maml"
ZOO_LIST = "redco list zoo"
SEQ2SEQ = "pip install --find-links dist redco-zoo-seq2seq"
NEW = "redco new --template seq2seq myproj"
SLURM = "pip install --find-links dist redco-slurm"


def commands(block_text: str) -> list[str]:
    """The commands of a README block, comments and blank lines left out."""
    return [line.split("  #")[0].strip() for line in block_text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def passed(pytest_output: str) -> bool:
    return bool(re.search(r"\b\d+ passed\b", pytest_output)) and not re.search(
        r"\b\d+ (failed|errors?|skipped)\b", pytest_output)


def launchers(help_text: str) -> set[str]:
    found = re.search(r"--launcher \{([^}]*)\}", help_text)
    assert found, f"no --launcher choices in `redco launch --help`:\n{help_text}"
    return {name for name in found.group(1).split(",") if name}


class Shell:
    """Runs lines with ``bash -ec`` as a user whose fresh venv at ``venv`` is activated."""

    def __init__(self, venv_dir: str, cwd: str):
        self.cwd = cwd
        path = os.environ["PATH"].split(os.pathsep)
        if sys.prefix != sys.base_prefix:  # this tox env's own bin/ is not the user's
            path = [p for p in path if p.rstrip("/") != os.path.join(sys.prefix, "bin")]
        # a user's shell has none (nor tox.ini's cheap-compile XLA_FLAGS: the main job trains
        # long enough that XLA's optimised code pays for its compile)
        dropped = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "XLA_FLAGS")
        self.env = {k: v for k, v in os.environ.items() if k not in dropped}
        self.env.update(VIRTUAL_ENV=venv_dir, PATH=os.pathsep.join([os.path.join(venv_dir, "bin"), *path]))

    def __call__(self, lines: str, cwd: str | None = None) -> str:
        done = subprocess.run(["bash", "-ec", lines], cwd=cwd or self.cwd, env=self.env,
                              capture_output=True, text=True, timeout=1500)
        assert done.returncode == 0, f"`{lines}` failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
        return done.stdout


@pytest.fixture(scope="module")
def sh(tmp_path_factory) -> Shell:
    """A shell in a fresh clone-like copy of the repository whose wheels are built into ``dist/``,
    with a fresh venv activated in which the card's first line installed redco-zoo-maml."""
    root = tmp_path_factory.mktemp("user")
    with open(os.path.join(REPO, ".gitignore")) as f:
        ignored = [p.strip().rstrip("/") for p in f if p.strip() and not p.startswith(("#", "!"))]
    shutil.copytree(REPO, root / "redco", ignore=shutil.ignore_patterns(".git", *ignored))
    venv.create(root / "venv", with_pip=True)
    shell = Shell(str(root / "venv"), str(root / "redco"))
    shell(BUILD)
    shell(MAML)
    return shell


def test_the_lines_tested_here_are_the_readmes():
    documented = set(commands(block("install")))
    missing = [line for line in (BUILD, MAML, ZOO_LIST, SEQ2SEQ, NEW, SLURM) if line not in documented]
    assert not missing, (f"README.md's block 'install' lacks {missing}, which tests/install runs "
                         "as the documented install lines: put them back, or change both together")


def test_getting_started_shows_the_main_job_run_here():
    """docs/getting-started.md repeats the README's main job: the same lines, which
    ``test_the_main_job_runs_as_written`` runs."""
    assert block("main-job", "docs/getting-started.md") == block("main-job")


def test_every_distribution_states_its_license_as_an_spdx_string():
    """A TOML-table ``project.license`` is deprecated (setuptools warns at every build and stops
    building such projects in 2027); an SPDX string needs hatchling>=1.27. hatchling builds a
    local install without leaving ``build/`` or ``*.egg-info`` in the source tree."""
    found = glob.glob(os.path.join(REPO, "core", "pyproject.toml")) + glob.glob(
        os.path.join(REPO, "*", "*", "pyproject.toml"))
    assert len(found) > 10, found
    for path in found:
        with open(path) as f:
            text = f.read()
        assert re.search(r'^license = "[\w.-]+"$', text, re.M), f'{path}: license = "Apache-2.0"'
        assert re.search(r'^requires = \["hatchling>=1.27"\]$', text, re.M), path


def test_the_main_job_runs_as_written(sh):
    """The README's main-job block, verbatim, in the fresh copy: it makes its own .venv, installs,
    trains and leaves what the README says under workdir/lm-demo."""
    out = sh(block("main-job"))
    log = os.path.join(sh.cwd, "workdir", "lm-demo", "log.txt")
    with open(log) as f:
        text = f.read()
    perplexity = float(re.search(r"perplexity ([\d.]+) \(bytes", text).group(1))
    # per byte: uniform is 256; byte frequencies alone give exp(3.26) = 26 on these docs
    assert perplexity < 26, text[-3000:]
    assert "sample: The import statement" in text, out[-3000:]
    demo = os.listdir(os.path.join(sh.cwd, "workdir", "lm-demo"))
    assert {"ckpts", "metrics.jsonl", "tensorboard", "log.txt"} <= set(demo), demo
    leftovers = ("*/build", "*/*/build", "*/*.egg-info", "*/*/*.egg-info")
    left = [os.path.relpath(p, sh.cwd) for pattern in leftovers
            for p in glob.glob(os.path.join(sh.cwd, pattern))]
    assert not left, f"installing (or building wheels) left {left} in the source tree"


def test_the_build_makes_a_wheel_of_every_distribution(sh):
    expected = set()
    for pyproject in glob.glob(os.path.join(sh.cwd, "*", "pyproject.toml")) + glob.glob(
            os.path.join(sh.cwd, "*", "*", "pyproject.toml")):
        with open(pyproject) as f:
            expected.add(re.search(r'^name = "(.+)"', f.read(), flags=re.M).group(1).replace("-", "_"))
    built = {name.split("-")[0] for name in os.listdir(os.path.join(sh.cwd, "dist"))}
    assert {"redco", "redco_zoo_maml", "redco_zoo_seq2seq", "redco_slurm"} <= expected
    assert built == expected


def test_a_zoo_package_and_a_project_from_its_template(sh):
    assert "maml" in [line.split()[0] for line in sh(ZOO_LIST).splitlines() if line.strip()]
    sh(SEQ2SEQ)
    sh(NEW)
    steps = block("install-and-test", os.path.join(sh.cwd, "myproj", "README.md"))
    out = sh(steps, cwd=os.path.join(sh.cwd, "myproj"))  # its install line and its tests, verbatim
    assert passed(out), out[-3000:]
    assert "Location: " + os.path.join(sh.env["VIRTUAL_ENV"], "lib") in sh("pip show pytest")


def test_installing_redco_slurm_adds_slurm_to_redco_launch(sh):
    before = launchers(sh("redco launch --help"))
    assert "slurm" not in before
    sh(SLURM)
    assert launchers(sh("redco launch --help")) == before | {"slurm"}
    assert "redco-slurm" in sh("redco list plugins")


def test_a_plugin_project_installed_as_its_readme_says_is_listed_and_used(sh):
    sh("redco new --template plugin myplug")
    steps = block("install-and-test", os.path.join(sh.cwd, "myplug", "README.md"))
    out = sh(steps, cwd=os.path.join(sh.cwd, "myplug"))
    listed = [line for line in out.splitlines() if line.split()[:1] == ["myplug"]]
    assert listed and "register_sharding_rules" in listed[0], out[-3000:]
    assert passed(out), out[-3000:]
