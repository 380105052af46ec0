"""Every code block of every README says how it is checked, and what it says is true: a block
``run by`` a test is looked up by that test under its name (or, for ``.ci/run``, stands in it
verbatim), so the blocks a user is meant to run are the ones the suite runs; the rest are marked
as sketches or as needing what this machine lacks (see ``tests/readme_blocks.py``)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from readme_blocks import REPO, blocks, n_blocks, readmes  # noqa: E402

README_PATHS = readmes()


def test_the_readmes_are_found():
    names = {os.path.relpath(p, REPO) for p in README_PATHS}
    assert {"README.md", "zoo/seq2seq/redco_zoo_seq2seq/template/README.md",
            "core/redco/project_templates/plugin/README.md"} <= names, names


@pytest.mark.parametrize("path", README_PATHS, ids=lambda p: os.path.relpath(p, REPO))
def test_every_block_is_marked_and_every_run_is_real(path):
    marked = blocks(path)
    assert len(marked) == n_blocks(path), (
        f"{path}: {n_blocks(path) - len(marked)} ```bash/```python block(s) have no "
        "`<!-- block NAME: run by PATH | sketch (...) | needs ... -->` line just above them")
    names = [b.name for b in marked]
    assert len(set(names)) == len(names), f"{path}: a block name is used twice: {names}"
    for b in marked:
        assert b.how.startswith(("run by ", "sketch (", "needs ")), f"{path} '{b.name}': {b.how}"
        if not b.how.startswith("run by "):
            continue
        runner = os.path.join(REPO, b.how.removeprefix("run by "))
        assert os.path.isfile(runner), f"{path} '{b.name}' is run by {runner}, which is missing"
        with open(runner) as f:
            code = f.read()
        verbatim = all(line in code for line in b.text.splitlines()
                       if line.strip() and not line.startswith("#"))
        assert f'"{b.name}"' in code or verbatim, (
            f"{runner} neither looks up block '{b.name}' of {path} nor holds its lines")
