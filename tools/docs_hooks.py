"""MkDocs hook (``hooks:`` in mkdocs.yml): the reference pages that are generated when the site
is built, so they cannot drift from the code.

* ``<!-- generated: cli -->`` becomes the ``--help`` of ``redco``, of each of its subcommands and
  of each installed zoo pipeline (``redco zoo run NAME --help``), as argparse prints them. It
  needs redco and the plugins and zoo packages to document installed where mkdocs runs
  (``tox -e docs`` installs them).
* ``<!-- generated: hookspecs -->`` becomes every hook of ``core/redco/hookspecs.py`` with its
  docstring, read from the source (nothing imported).
* ``<!-- generated: api -->`` becomes the public API (``redco.__all__``): each class's
  signature and docstring, then each of its public methods and properties'.
* ``BENCHMARKS.md`` (at the repository's root, where each bench's output is pasted with its
  commit) becomes one page per section (``benchmarks/<n>.md``: one measured claim each), in the
  nav under the benchmarks page, and ``<!-- generated: benchmarks -->`` its introduction and a
  list of them.
"""
from __future__ import annotations

import ast
import contextlib
import inspect
import io
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def benchmark_sections() -> tuple[str, list[tuple[str, str, str]]]:
    """BENCHMARKS.md's introduction and its ``## `` sections as ``(slug, title, body)``."""
    with open(os.path.join(REPO, "BENCHMARKS.md")) as f:
        intro, *sections = re.split(r"^## ", f.read(), flags=re.M)
    found = []
    for i, section in enumerate(sections):
        title, _, body = section.partition("\n")
        number = re.match(r"(\d+)\.", title)
        slug = number.group(1) if number else re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")
        found.append((slug or str(i), title.strip(), body))
    return intro.split("\n", 1)[1].strip(), found


def on_config(config):
    """The benchmarks' section of the nav: the benchmarks page, then one page per section."""
    pages = [{title: f"benchmarks/{slug}.md"} for slug, title, _ in benchmark_sections()[1]]
    config["nav"] = [{"Benchmarks": ["benchmarks.md", *pages]}
                     if entry == {"Benchmarks": "benchmarks.md"} else entry
                     for entry in config["nav"]]
    return config


def on_files(files, config):
    from mkdocs.structure.files import File
    for slug, title, body in benchmark_sections()[1]:
        files.append(File.generated(config, f"benchmarks/{slug}.md", content=f"# {title}\n{body}"))
    return files


def benchmarks_index() -> str:
    intro, sections = benchmark_sections()
    return intro + "\n\n" + "\n".join(f"- [{title}](benchmarks/{slug}.md)"
                                     for slug, title, _ in sections) + "\n"


def on_page_markdown(markdown: str, page, config, files) -> str:
    if "<!-- generated: cli -->" in markdown:
        markdown = markdown.replace("<!-- generated: cli -->", cli_reference())
    if "<!-- generated: hookspecs -->" in markdown:
        markdown = markdown.replace("<!-- generated: hookspecs -->", hooks_reference())
    if "<!-- generated: api -->" in markdown:
        markdown = markdown.replace("<!-- generated: api -->", api_reference())
    if "<!-- generated: benchmarks -->" in markdown:
        markdown = markdown.replace("<!-- generated: benchmarks -->", benchmarks_index())
    return markdown


def rst_to_markdown(text: str) -> str:
    """A docstring's ``code`` (reStructuredText) as `code` (markdown)."""
    return re.sub(r"``(.+?)``", r"`\1`", text, flags=re.S)


def hooks_reference() -> str:
    with open(os.path.join(REPO, "core", "redco", "hookspecs.py")) as f:
        module = ast.parse(f.read())
    parts = [rst_to_markdown(inspect.cleandoc(ast.get_docstring(module)))]
    for node in module.body:
        if isinstance(node, ast.FunctionDef) and any(
                isinstance(d, ast.Name) and d.id == "hookspec" for d in node.decorator_list):
            args = ", ".join(a.arg for a in node.args.args)
            doc = ast.get_docstring(node)
            assert doc, f"hookspecs.py: {node.name} has no docstring"
            parts.append(f"## `{node.name}`\n\n```text\n{node.name}({args})\n```\n\n"
                         + rst_to_markdown(inspect.cleandoc(doc)))
    return "\n\n".join(parts) + "\n"


def help_of(argv: list[str]) -> str:
    """What ``redco ARGV`` prints (``--help``), run in this process."""
    from redco import cli
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        cli.main(argv)
    return out.getvalue().rstrip()


def cli_reference() -> str:
    os.environ["COLUMNS"] = "100"  # argparse wraps to this width, wherever the site is built
    from redco import plugins
    fixed = ["list", "launch", "new", "zoo"]  # (plugins: the same as list plugins)
    commands = fixed + sorted(set(plugins.registry("commands")) - set(fixed))
    sections = [("redco", ["--help"])]
    sections += [(f"redco {name}", [name, "--help"]) for name in commands]
    sections += [(f"redco zoo run {name}", ["zoo", "run", name, "--help"])
                 for name in sorted(plugins.registry("zoo_pipelines"))]
    return "\n\n".join(f"## `{title}`\n\n```text\n{help_of(argv)}\n```"
                       for title, argv in sections) + "\n"


def documented(name: str, obj) -> str:
    """``name``'s signature (where it has one) and docstring, as markdown."""
    try:
        signature = f"{name}{inspect.signature(obj)}"
    except (TypeError, ValueError):
        signature = name
    doc = inspect.getdoc(obj) or "(no docstring)"
    return f"```text\n{signature}\n```\n\n{rst_to_markdown(doc)}"


def api_reference() -> str:
    import redco
    parts = []
    for name in redco.__all__:
        obj = getattr(redco, name)
        parts.append(f"## `redco.{name}`\n\n" + documented(name, obj))
        if not inspect.isclass(obj):
            continue
        for member, value in sorted(vars(obj).items()):
            if member.startswith("_") or not (callable(value) or isinstance(value, property)):
                continue
            target = value.fget if isinstance(value, property) else value
            parts.append(f"### `{name}.{member}`\n\n" + documented(member, target))
    return "\n\n".join(parts) + "\n"
