"""Where tests/docs find the built docs site (``mkdocs build`` puts it in ``$DOCS_SITE_DIR``,
else ``site/``; ``tox -e docs`` builds it first) and the pages mkdocs.yml's nav lists."""
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SITE = os.environ.get("DOCS_SITE_DIR", os.path.join(ROOT, "site"))


def require_built_site() -> None:
    if not os.path.isfile(os.path.join(SITE, "index.html")):
        pytest.fail(f"no built site at {SITE}: run `mkdocs build` (tox -e docs does)")


def nav_entries() -> list[tuple[str, str]]:
    """``(title, markdown file)`` of each page mkdocs.yml's nav lists, in its order (the
    benchmark sections' pages, which tools/docs_hooks.py adds under the benchmarks page, aside)."""
    with open(os.path.join(ROOT, "mkdocs.yml")) as f:
        nav = f.read().split("\nnav:\n", 1)[1]
    return re.findall(r"^\s*- (.+?):\s+(\S+\.md)\s*$", nav, re.M)


def url_of(markdown_file: str) -> str:
    """The site-relative URL of a page's markdown file (``guides/zoo.md`` -> ``guides/zoo/``)."""
    return "" if markdown_file == "index.md" else markdown_file.removesuffix(".md") + "/"
