"""The README's "What is tested" table points at checks that exist: every path in it is in the
repository, and every ``file::test`` names a test defined in that file."""
import os
import re

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def readme_table() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    return readme.split("\n## What is tested\n", 1)[1].split("\n## ", 1)[0]


def test_every_check_the_readme_names_exists():
    table = readme_table()
    named = re.findall(r"`((?:tests|plugins|bench)/[^`]*)`", table)
    assert len(named) >= 15, named
    for ref in named:
        path, _, test = ref.partition("::")
        assert os.path.exists(os.path.join(ROOT, path)), f"README names {path}, which does not exist"
        if test:
            with open(os.path.join(ROOT, path)) as f:
                assert f"def {test}(" in f.read(), f"README names {ref}, which is not defined"
