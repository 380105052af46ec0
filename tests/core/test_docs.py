"""docs/reference/environment.md names every ``REDCO_*`` environment variable found in the code:
those redco and its plugins and zoo packages read in its first table, those of the test suite,
tox.ini and the benchmarks anywhere on the page."""
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VARIABLE = re.compile(r"\bREDCO_[A-Z0-9_]*[A-Z0-9]\b")
# REDCO_* words in the code that are no variable: prefixes the multihost tests strip from the
# environment ("REDCO_HOST", "REDCO_PROCESS") and a Python name in two plugins' tests.
NOT_VARIABLES = {"REDCO_HOST", "REDCO_PROCESS", "REDCO_ENV"}
SOURCES = ("py", "sh", "toml", "ini", "cfg")


def found_in(paths) -> dict[str, str]:
    """Each REDCO_* word in ``paths``, with the first file that has it."""
    found = {}
    for path in paths:
        with open(path, errors="replace") as f:
            for name in VARIABLE.findall(f.read()):
                found.setdefault(name, os.path.relpath(path, ROOT))
    return found


def code_files(*patterns) -> list[str]:
    return sorted(p for pattern in patterns for ext in SOURCES
                  for p in glob.glob(os.path.join(ROOT, f"{pattern}.{ext}"), recursive=True))


def page_tables() -> tuple[str, str]:
    with open(os.path.join(ROOT, "docs", "reference", "environment.md")) as f:
        page = f.read()
    library = page.split("\n## Read by redco and its plugins\n", 1)[1].split("\n## ", 1)[0]
    return library, page


def test_the_environment_page_names_every_variable_the_library_reads():
    shipped = [p for p in code_files("core/**/*", "plugins/*/**/*", "zoo/*/**/*")
               if f"{os.sep}tests{os.sep}" not in p]
    found = found_in(shipped)
    assert {"REDCO_HANG_TIMEOUT", "REDCO_COMPILE_CACHE", "REDCO_HOSTS"} <= set(found), found
    library, _ = page_tables()
    listed = set(re.findall(r"^\| `(REDCO_[A-Z0-9_]+)` \|", library, re.M))
    missing = {name: where for name, where in found.items() if name not in listed}
    assert not missing, f"docs/reference/environment.md's first table lacks {missing}"
    stale = listed - set(found)
    assert not stale, f"docs/reference/environment.md lists {stale}, which no code reads"


def test_the_environment_page_names_every_variable_of_the_tests_and_benchmarks():
    found = found_in(code_files("tests/**/*", "plugins/*/tests/**/*", "bench/**/*", "conftest",
                                "tox"))
    assert {"REDCO_SLOW_TESTS", "REDCO_TEST_KILL_AT_STEP"} <= set(found), found
    _, page = page_tables()
    missing = {name: where for name, where in found.items()
               if name not in NOT_VARIABLES and f"`{name}`" not in page}
    assert not missing, f"docs/reference/environment.md lacks {missing}"
