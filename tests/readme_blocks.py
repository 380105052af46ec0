"""The code blocks of the project's READMEs and docs pages, each with the marker that says how it
is checked.

Every ```bash and ```python block in a README, in CONTRIBUTING.md or in a page of the docs site
(``docs/**/*.md``) is preceded by one HTML comment (invisible once rendered) naming the block and
saying how it is checked:

    <!-- block main-job: run by tests/install/test_install.py -->
    <!-- block three-functions: sketch (generate, train, valid, score are the user's) -->
    <!-- block launch: needs a SLURM cluster and hosts to run on -->

``run by PATH``: the test at PATH looks the block up by its name (and, for any file but README.md,
that file's path: ``block("lora", "docs/guides/lora-and-remat.md")``) and runs it as written
(or, for ``.ci/run``, holds its lines verbatim). ``tests/core/test_readme_blocks.py`` checks that every
block is marked and every ``run by`` is true.
"""
from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKED = re.compile(r"^<!-- block ([\w-]+): (.*?) -->\n```(bash|python)\n(.*?)^```", re.M | re.S)
ANY_BLOCK = re.compile(r"^```(bash|python)\n", re.M)


@dataclass
class Block:
    name: str
    how: str       # "run by PATH", "sketch (...)" or "needs ..."
    language: str
    text: str


def readmes() -> list[str]:
    """Every page a user reads: the project's README and CONTRIBUTING.md, every page of the docs
    site, the templates' guide and each template's README."""
    patterns = ["README.md", "CONTRIBUTING.md", "docs/**/*.md", "templates/README.md",
                "core/redco/project_templates/*/README.md", "zoo/*/redco_zoo_*/template/README.md"]
    return sorted(p for pattern in patterns
                  for p in glob.glob(os.path.join(REPO, pattern), recursive=True))


def blocks(path: str) -> list[Block]:
    with open(path) as f:
        return [Block(*found.groups()) for found in MARKED.finditer(f.read())]


def block(name: str, path: str = "README.md") -> str:
    """The text of the block called ``name`` in the page at ``path`` (relative to the repository
    root, or absolute: a generated project's README)."""
    path = os.path.join(REPO, path)
    found = [b for b in blocks(path) if b.name == name]
    assert len(found) == 1, f"{path} has {len(found)} blocks marked '{name}', not one"
    return found[0].text


def n_blocks(path: str) -> int:
    """How many ```bash and ```python blocks ``path`` has, marked or not."""
    with open(path) as f:
        return len(ANY_BLOCK.findall(f.read()))
