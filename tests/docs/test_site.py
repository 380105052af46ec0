"""The built docs site (``mkdocs build``, into ``$DOCS_SITE_DIR``, else ``site/``) has a page for
every entry of mkdocs.yml's nav, and every link of every built page that stays inside the site
reaches a built file, and its ``#anchor`` an element of that page with that id. ``tox -e docs``
builds the site and runs this; no browser is needed (the HTML is parsed as text; test_browser.py
opens the site in one)."""
import html.parser
import os
import posixpath
import re
import urllib.parse

from built_site import ROOT, SITE, nav_entries, require_built_site, url_of


class Page(html.parser.HTMLParser):
    """The links (``href``/``src``) and element ids of one HTML page."""

    def __init__(self):
        super().__init__()
        self.links, self.ids = [], set()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        for name in ("href", "src"):
            if attrs.get(name) is not None:
                self.links.append(attrs[name])


def parse(path: str) -> Page:
    page = Page()
    with open(path, encoding="utf-8") as f:
        page.feed(f.read())
    return page


def built_pages() -> list[str]:
    """Every HTML file of the site, relative to it (``/``-separated)."""
    require_built_site()
    return sorted(os.path.relpath(os.path.join(d, f), SITE).replace(os.sep, "/")
                  for d, _, files in os.walk(SITE) for f in files if f.endswith(".html"))


def target(page: str, link: str) -> tuple[str, str] | None:
    """The site file and anchor an internal ``link`` of ``page`` points at; None if external."""
    parts = urllib.parse.urlsplit(link)
    if parts.scheme or parts.netloc or link.startswith(("mailto:", "javascript:")):
        return None
    path = urllib.parse.unquote(parts.path)
    if not path:
        resolved = page
    else:  # (404.html links from the site's root: it is served at any depth)
        base = "" if path.startswith("/") else posixpath.dirname(page)
        resolved = posixpath.normpath(posixpath.join(base, path.lstrip("/")))
        if path.endswith("/") or os.path.isdir(os.path.join(SITE, resolved)):
            resolved = posixpath.join(resolved, "index.html")
    return resolved, parts.fragment


def test_every_nav_entry_is_a_built_page():
    pages = set(built_pages())
    nav = [md for _, md in nav_entries()]
    assert len(nav) >= 15, nav
    for md in nav:
        html_file = url_of(md) + "index.html"
        assert html_file in pages, f"mkdocs.yml's nav names {md}, but {html_file} was not built"


def test_every_internal_link_reaches_a_built_file_and_anchor():
    pages = built_pages()
    parsed = {p: parse(os.path.join(SITE, p)) for p in pages}
    broken = []
    n_checked = 0
    for page, found in parsed.items():
        for link in found.links:
            hit = target(page, link)
            if hit is None:
                continue
            n_checked += 1
            path, anchor = hit
            if path.startswith("../") or not os.path.isfile(os.path.join(SITE, path)):
                broken.append(f"{page}: {link} (no {path})")
            elif anchor and path.endswith(".html") and anchor not in parsed[path].ids:
                broken.append(f"{page}: {link} (no id {anchor!r} in {path})")
    assert n_checked > 500, n_checked  # the nav alone links every page from every page
    assert not broken, "\n".join(broken[:50])


def test_the_generated_reference_pages_hold_the_code_s_own_text():
    """The API, CLI and hooks pages are generated from the code when the site is built: each
    public class of ``redco`` and each public method of it is there with its docstring's first
    line, as are every hook and the ``redco`` command's subcommands."""
    import html as html_module
    import inspect

    import redco
    from redco import hookspecs

    def text_of(page: str) -> str:
        with open(os.path.join(SITE, page), encoding="utf-8") as f:
            return " ".join(html_module.unescape(re.sub(r"<[^>]+>", " ", f.read())).split())
    api = text_of("reference/api/index.html")
    for name in redco.__all__:
        obj = getattr(redco, name)
        assert f"redco.{name}" in api, name
        members = [(m, v) for m, v in vars(obj).items() if not m.startswith("_")
                   and (callable(v) or isinstance(v, property))] if inspect.isclass(obj) else []
        for member, value in members:
            doc = inspect.getdoc(value.fget if isinstance(value, property) else value)
            assert f"{name}.{member}" in api, f"{name}.{member}"
            first = "".join(re.sub(r"``(.+?)``", r"\1", doc or "(no docstring)")
                            .split("\n\n")[0].split())[:40]  # (spaces aside: tags move them)
            assert first in "".join(api.split()), (f"{name}.{member}", first)
    hooks = text_of("reference/hooks/index.html")
    for name in dir(hookspecs):
        if getattr(getattr(hookspecs, name), "redco_spec", None) is not None:
            assert name in hooks, name
    assert "redco zoo run lm" in text_of("reference/cli/index.html")


def test_every_benchmark_section_is_a_page_of_its_own_linked_from_the_index():
    """BENCHMARKS.md's sections are built into one page each (one measured claim a page),
    holding the section's title and its provenance (the ``commit:`` lines its bench printed),
    and the benchmarks page links every one."""
    with open(os.path.join(ROOT, "BENCHMARKS.md")) as f:
        sections = re.split(r"^## ", f.read(), flags=re.M)[1:]
    assert len(sections) > 20, len(sections)
    index = parse(os.path.join(SITE, "benchmarks", "index.html"))
    linked = {target("benchmarks/index.html", link)[0] for link in index.links
              if target("benchmarks/index.html", link) is not None}
    for section in sections:
        title = section.split("\n", 1)[0].strip()
        number = re.match(r"(\d+)\.", title)
        slug = number.group(1) if number else re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")
        page = f"benchmarks/{slug}/index.html"
        assert page in linked, f"the benchmarks page does not link {title!r}"
        with open(os.path.join(SITE, page), encoding="utf-8") as f:
            built = f.read()
        for commit in re.findall(r"^commit: (\S+)", section, re.M):
            assert f"commit: {commit}" in built, (title, commit)
