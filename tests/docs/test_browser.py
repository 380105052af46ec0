"""The built docs site as a reader's browser shows it: served over HTTP on 127.0.0.1 and opened in
a real headless Chromium (tests/docs/devtools.py drives it), JavaScript and all.

The home page renders its navigation (Material's sidebar, laid out by its stylesheet) with every
page mkdocs.yml's nav lists, under its nav title; every entry of that rendered navigation opens
(HTTP 200, the page's title and heading, each code block given its copy button by Material's
JavaScript, no uncaught JavaScript exception, nothing requested from outside the site: it works
offline); the search (Material's lunr index, in a web worker) answers a query with the right page
first; and the browser leaves no process behind.

``tox -e docs`` installs Chromium first (tests/docs/chromium.sh, Debian's package). Without it the
test fails under ``CI=true`` and is skipped elsewhere, saying how to install it.
"""
import functools
import http.server
import os
import shutil
import threading
import urllib.parse

import pytest
from built_site import SITE, nav_entries, require_built_site, url_of
from devtools import Chromium, Page, session_processes

INSTALL = ("no chromium on PATH: install it with `bash tests/docs/chromium.sh` as root "
           "(Debian's `apt-get install chromium`), or put a Chromium binary named chromium on PATH")

# (query, the page the search must answer first): a word of that page's title, and a word of its
# text (the commands' reference names it too).
SEARCHES = [("rematerialisation", "guides/lora-and-remat/"), ("sbatch", "tutorials/multi-host/")]

# The primary navigation's page links (the active page's table of contents, which Material nests
# in it, aside), as [text, absolute URL, rendered height].
NAV_LINKS = """[...document.querySelectorAll('.md-nav--primary a.md-nav__link[href]')]
    .filter(a => !a.closest('.md-nav--secondary'))
    .map(a => [a.textContent.trim(), a.href, a.getBoundingClientRect().height])"""

# Each code block of the page has the copy button Material's JavaScript adds to it
# (``content.code.copy`` in mkdocs.yml); the number of code blocks.
CODE_BLOCKS_READY = """(() => {
    const blocks = document.querySelectorAll('.md-content pre > code');
    const buttons = document.querySelectorAll('.md-content pre button[data-md-type="copy"]');
    return blocks.length === buttons.length && {blocks: blocks.length};
})()"""


def chromium_binary() -> str:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        if os.environ.get("CI") == "true":
            pytest.fail(INSTALL + " (CI=true: this check may not be skipped)")
        pytest.skip(INSTALL)
    return binary


@pytest.fixture(scope="module")
def site_url():
    """The built site served on a free port of 127.0.0.1, for the module's tests."""
    require_built_site()

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=SITE))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()
    thread.join()


def start_browser(tmp_path_factory) -> Chromium:
    work = tmp_path_factory.mktemp("chromium")
    return Chromium(chromium_binary(), str(work / "profile"), str(work / "chromium.log"))


@pytest.fixture(scope="module")
def page(site_url, tmp_path_factory):
    browser = start_browser(tmp_path_factory)
    try:
        yield browser.new_page()
    finally:
        browser.close()


@pytest.fixture(scope="module")
def rendered_nav(page: Page, site_url: str) -> list[list]:
    """The home page's rendered navigation."""
    assert page.goto(site_url) == 200
    sidebar = page.wait_for("""(() => { const s = document.querySelector('.md-sidebar--primary');
        return s && getComputedStyle(s).position === 'sticky' && s.getBoundingClientRect().width;
        })()""", "the home page shows the navigation sidebar, laid out by Material's stylesheet")
    assert sidebar > 100, sidebar
    return page.evaluate(NAV_LINKS)


def test_the_home_page_shows_every_page_of_the_nav(rendered_nav, site_url):
    shown = {href: (text, height) for text, href, height in rendered_nav}
    entries = nav_entries()
    assert len(entries) >= 15, entries
    for title, markdown_file in entries:
        href = site_url + url_of(markdown_file)
        assert href in shown, f"the home page's navigation has no link to {markdown_file} ({href})"
        text, height = shown[href]
        assert text == title, f"{markdown_file} is shown as {text!r}, mkdocs.yml names it {title!r}"
        assert height > 0, f"the link to {markdown_file} is not displayed"


def test_every_nav_entry_opens_with_its_title_heading_and_script(page, rendered_nav, site_url):
    n_blocks = 0
    for text, href, _ in rendered_nav:
        assert page.goto(href) == 200, f"{text!r}: {href} did not answer 200"
        title = page.evaluate("document.title")
        expected = "Redco" if href == site_url else f"{text} - Redco"
        assert title == expected, f"{href}: title {title!r}, its nav entry is {text!r}"
        heading = page.evaluate("(document.querySelector('.md-content h1') || {}).textContent")
        assert heading and heading.strip(" ¶"), f"{href} has no heading"
        n_blocks += page.wait_for(CODE_BLOCKS_READY, f"{href}: Material's script ran")["blocks"]
        assert not page.exceptions(), f"{href}: JavaScript errors {page.exceptions()}"
    outside = [url for url in page.requests() if not url.startswith((site_url, "data:"))]
    assert not outside, f"the pages load from outside the site: {sorted(set(outside))}"
    assert len(rendered_nav) > len(nav_entries()), "the benchmark sections' pages are in the nav"
    assert n_blocks > 20, n_blocks  # (the copy-button check is not vacuous)


@pytest.mark.parametrize("query,expected", SEARCHES)
def test_the_search_finds_the_page(page, site_url, query, expected):
    assert page.goto(f"{site_url}?q={urllib.parse.quote(query)}") == 200
    links = page.wait_for("""[...document.querySelectorAll('.md-search-result__list > li a')]
        .map(a => a.href)""", f"the search answers {query!r}")
    first = urllib.parse.urlsplit(links[0])
    assert first.path == "/" + expected, (
        f"the search's first answer to {query!r} is {links[0]}, not {expected}: {links}")
    assert not page.exceptions(), page.exceptions()


def test_the_browser_leaves_no_process_behind(site_url, tmp_path_factory):
    browser = start_browser(tmp_path_factory)
    try:
        assert browser.new_page().goto(site_url) == 200
        assert len(session_processes(browser.process.pid)) > 2  # (renderer, GPU, zygotes...)
    finally:
        browser.close()
    assert browser.process.returncode is not None
    left = session_processes(browser.process.pid)
    assert not left, f"Chromium processes (zombies included) left after close: {left}"


def test_a_missing_browser_fails_under_ci_and_is_skipped_elsewhere(monkeypatch, tmp_path):
    def outcome() -> BaseException:  # (a skip caught here, not one of this test)
        try:
            chromium_binary()
        except BaseException as raised:
            return raised
        raise AssertionError("a browser was found on an empty PATH")
    monkeypatch.setenv("PATH", str(tmp_path))  # (an empty directory: no chromium on PATH)
    monkeypatch.setenv("CI", "true")
    failed = outcome()
    assert isinstance(failed, pytest.fail.Exception), repr(failed)
    assert "CI=true: this check may not be skipped" in str(failed), failed
    monkeypatch.delenv("CI")
    skipped = outcome()
    assert isinstance(skipped, pytest.skip.Exception), repr(skipped)
    assert "tests/docs/chromium.sh" in str(skipped), skipped
