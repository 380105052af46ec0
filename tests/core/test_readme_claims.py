"""CONTRIBUTING.md's "What is tested" table (each claim of the README and the docs pages, and its
check) points at checks that exist: every path in it is in the repository, and every
``file::test`` names a test defined in that file. Its "Environments" table names every tox
environment of the default list."""
import os
import re

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def section(title: str) -> str:
    with open(os.path.join(ROOT, "CONTRIBUTING.md")) as f:
        text = f.read()
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_every_check_the_table_names_exists():
    table = section("What is tested")
    named = re.findall(r"`((?:tests|plugins|bench)/[^`]*)`", table)
    assert len(named) >= 15, named
    for ref in named:
        path, _, test = ref.partition("::")
        assert os.path.exists(os.path.join(ROOT, path)), (
            f"CONTRIBUTING.md names {path}, which does not exist")
        if test:
            with open(os.path.join(ROOT, path)) as f:
                assert f"def {test}(" in f.read(), (
                    f"CONTRIBUTING.md names {ref}, which is not defined")


def test_the_environments_table_names_every_tox_environment_of_the_default_list():
    with open(os.path.join(ROOT, "tox.ini")) as f:
        env_list = re.search(r"^env_list = (.*)$", f.read(), re.M).group(1).split(", ")
    rows = re.findall(r"^\| `([\w-]+)` \|", section("Environments"), re.M)
    assert len(env_list) > 10 and set(env_list) <= set(rows), set(env_list) - set(rows)
