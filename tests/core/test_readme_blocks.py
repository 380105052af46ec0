"""Every code block of every README and docs page says how it is checked, and what it says is true: a
block ``run by`` a test file is executed by it: a ``test_*`` function there calls
``block("<name>")`` (with the page's path for any page but the project's README: for CONTRIBUTING.md
and the docs site's pages that path as written, relative to the repository root, ``block("lora",
"docs/guides/lora-and-remat.md")``) and uses what it returns; ``.ci/run`` holds its block's lines
verbatim. So the blocks a user is meant to run are the ones the suite runs; the rest are marked as
sketches or as needing what this machine lacks (see ``tests/readme_blocks.py``)."""
import ast
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from readme_blocks import REPO, Block, blocks, n_blocks, readmes  # noqa: E402

README_PATHS = readmes()


def test_the_readmes_are_found():
    names = {os.path.relpath(p, REPO) for p in README_PATHS}
    assert {"README.md", "CONTRIBUTING.md", "docs/getting-started.md",
            "docs/guides/lora-and-remat.md", "zoo/seq2seq/redco_zoo_seq2seq/template/README.md",
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
        why = why_not_run(runner, b, os.path.relpath(path, REPO))
        assert why is None, f"{path} '{b.name}' is run by {runner}, but {why}"


def path_argument(page: str) -> str | bool | None:
    """What a ``block(name, ...)`` call must give as the page's path: nothing for README.md; for
    CONTRIBUTING.md and the docs site's pages, their path relative to the repository root as a
    string literal; for a template's README (written by ``redco new`` somewhere else) any path
    (``True``)."""
    if page == "README.md":
        return None
    if page == "CONTRIBUTING.md" or page.startswith("docs" + os.sep):
        return page
    return True


def why_not_run(runner: str, b: Block, page: str) -> str | None:
    """None if ``runner`` executes block ``b`` of ``page`` (relative to the repository root): a
    test file looks it up by name (and path) in a ``test_*`` function and uses the text (see
    ``block_lookups``); another file (``.ci/run``) holds its lines verbatim. Else what is
    missing."""
    with open(runner) as f:
        code = f.read()
    if runner.endswith(".py"):
        given = path_argument(page)
        lookups = block_lookups(code)
        found = (b.name, given) in lookups or (
            given is True and any(name == b.name and path is not None for name, path in lookups))
        shown = {None: "", True: ", <its README path>"}.get(given, f", {given!r}")
        return None if found else (
            f"no test_* function there calls block({b.name!r}{shown}) and uses the text: "
            "call it there and run it")
    lines = [line for line in b.text.splitlines() if line.strip() and not line.startswith("#")]
    missing = [line for line in lines if line not in code]
    return f"it lacks the block's lines {missing}: copy them verbatim" if missing else None


def block_lookups(code: str) -> set[tuple[str, str | bool | None]]:
    """``(name, path)`` of each ``block("<name>", ...)`` call inside a top-level ``test_*``
    function whose value is used (not a bare statement): ``path`` is None when the call gives
    none (or ``"README.md"``), the string when it gives another string literal, ``True`` when it
    gives an expression."""
    found = set()
    for test in ast.parse(code).body:
        if not (isinstance(test, ast.FunctionDef) and test.name.startswith("test_")):
            continue
        bare = {id(s.value) for s in ast.walk(test) if isinstance(s, ast.Expr)}
        for call in ast.walk(test):
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                    and call.func.id == "block" and id(call) not in bare and call.args
                    and isinstance(call.args[0], ast.Constant)):
                given = call.args[1:2] or [k.value for k in call.keywords if k.arg == "path"]
                path = (None if not given else given[0].value
                        if isinstance(given[0], ast.Constant) else True)
                found.add((call.args[0].value, None if path == "README.md" else path))
    return found
