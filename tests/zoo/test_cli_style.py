"""One style for the ``redco`` command (issue 45 point 4): every flag of every command is spelled
with underscores in its ``--help`` (an old dashed spelling still parses, hidden); ``redco
--version``; an argument error is one line with exit status 2, naming the flag or command a
typo was likely meant to be; ``redco list`` is the one listing (the older ``redco plugins``,
``redco zoo list`` and ``redco new --list`` print the same as its sections); a ValueError that
Redco raises checking its input is one line too, any other keeps its traceback.

The commands walked are ``redco``'s own and those of every plugin registered here, and also
every command, launcher and zoo pipeline of this repository's packages read from their
sources (so a plugin this environment lacks is walked too, when its module imports)."""
import importlib
import re
import sys
from pathlib import Path

import pytest
import tomllib

from redco import cli
from redco.cli_parser import Parser
from redco.plugins import DeferredCommand

ROOT = Path(__file__).resolve().parents[2]
FLAG = re.compile(r"--[\w-]+")


def subparsers(parser, prog):
    """``(prog, parser)`` for ``parser`` and every subcommand under it."""
    yield prog, parser
    for action in parser._actions:
        if isinstance(action.choices, dict):
            for name, sub in action.choices.items():
                yield from subparsers(sub, f"{prog} {name}")


def repo_hooks():
    """Every ``redco`` entry point's module in plugins/ and zoo/, imported from its source;
    a module whose dependencies this environment lacks is left out."""
    for pyproject in sorted([*ROOT.glob("plugins/*/pyproject.toml"), *ROOT.glob("zoo/*/pyproject.toml")]):
        entry_points = tomllib.loads(pyproject.read_text())["project"].get("entry-points", {})
        for module in entry_points.get("redco", {}).values():
            if str(pyproject.parent) not in sys.path:
                sys.path.append(str(pyproject.parent))
            try:
                yield importlib.import_module(module)
            except ImportError:
                continue


def registered(hook: str) -> dict:
    found = {}
    for module in repo_hooks():
        if hasattr(module, hook):
            getattr(module, hook)(lambda name, obj: found.setdefault(name, obj))
    return {name: thing for name, thing in found.items() if importable(thing)}


def importable(thing) -> bool:
    """False for a zoo pipeline registered by where it lives (``DeferredCommand``) whose module's
    dependencies this environment lacks, as for a plugin module in ``repo_hooks``."""
    try:
        if isinstance(thing, DeferredCommand):
            thing.load()
    except ImportError:
        return False
    return True


def every_parser():
    """``(title, parser)`` for every command of ``redco`` and of this repository's packages."""
    yield from subparsers(cli.build_parser(), "redco")
    for name, command in registered("register_commands").items():
        parser = Parser(prog=f"redco {name}")
        command.add_arguments(parser)
        yield f"redco {name}", parser
    for name, launcher in registered("register_launchers").items():
        parser = Parser(prog=f"redco launch --launcher {name}")
        launcher.add_arguments(parser.add_argument_group(name))
        yield f"redco launch --launcher {name}", parser
    for name, pipeline in registered("register_zoo_pipelines").items():
        yield f"redco zoo run {name}", cli.zoo_parser(name, pipeline)


PARSERS = dict(every_parser())


def shown_flags(help_text: str) -> list[str]:
    """The flags ``--help`` names: in its usage and at the start of its option lines (not the
    flags of other programs that its help sentences may quote)."""
    usage, _, rest = help_text.partition("\n\n")
    lines = [re.split(r"\s{2,}", line.strip())[0] for line in rest.splitlines()
             if line.lstrip().startswith("-")]
    return FLAG.findall(usage) + [flag for line in lines for flag in FLAG.findall(line)]


def test_the_walk_reaches_the_commands():
    assert {"redco", "redco list", "redco new", "redco zoo", "redco zoo run lm", "redco plan",
            "redco launch --launcher ip"} <= set(PARSERS), sorted(PARSERS)


@pytest.mark.parametrize("title", sorted(PARSERS))
def test_every_flag_is_spelled_with_underscores(title):
    flags = shown_flags(PARSERS[title].format_help())
    assert flags, title
    dashed = sorted({flag for flag in flags if "-" in flag[2:]})
    assert not dashed, f"{title} --help shows {dashed}: spell them with underscores (keep the " \
        "old spelling as a hidden alias: add_argument('--new_name', '--old-name', ...))"


def test_an_old_spelling_still_parses_and_is_hidden():
    parser = PARSERS["redco plan"]
    args = parser.parse_args(["--model", "llama-tiny", "--devices", "8", "--device-memory", "1GB",
                              "--seq-len", "64", "--batch", "2", "--context-shards", "1,2"])
    assert (args.device_memory, args.seq_len, args.per_device_batch_size,
            args.n_context_shards) == ("1GB", 64, 2, [1, 2])
    assert "--seq-len" not in parser.format_help() and "--seq_len" in parser.format_help()
    lm = PARSERS["redco zoo run lm"]
    assert [lm.parse_args(["--model", "m", "--train", "t", *pack]).pack
            for pack in ([], ["--pack"], ["--no_pack"], ["--no-pack"])] == [True, True, False, False]
    assert "--pack | --no_pack" in lm.format_usage() and "--no-pack" not in lm.format_help()


def error_line(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as stop:
        cli.main(list(argv))
    lines = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(lines) == 1, lines
    return lines[0]


def test_argument_errors_are_one_line_naming_what_was_meant(capsys):
    line = error_line(capsys, "lsit")
    assert line.startswith("redco: error: argument command: invalid choice: 'lsit' (choose from")
    assert line.endswith("(did you mean list?)")
    assert error_line(capsys, "new", "x", "--tempalte", "lm").endswith(
        "unrecognized arguments: --tempalte lm (did you mean --template?)")
    assert error_line(capsys, "list", "templtes").endswith("(did you mean templates?)")
    # (flags with old spellings: plugins/planner/tests/test_cli_rules.py, where plan is)


def test_version(capsys):
    from importlib.metadata import version
    with pytest.raises(SystemExit) as stop:
        cli.main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out.strip() == f"redco {version('redco')}"


def printed(capsys, *argv) -> str:
    cli.main(list(argv))
    return capsys.readouterr().out


def test_one_listing_command(capsys):
    from redco.plugins import list_plugins, registry
    everything = printed(capsys, "list")
    assert [line for line in everything.splitlines() if not line.startswith(" ")] == \
        ["templates:", "zoo:", "plugins:"]
    names = [*registry("templates"), *registry("zoo_pipelines"), *(r["name"] for r in list_plugins())]
    assert all(f"  {name} " in everything for name in names), everything
    for old, section in ((["plugins"], "plugins"), (["zoo", "list"], "zoo"),
                         (["new", "--list"], "templates")):
        assert printed(capsys, *old) == printed(capsys, "list", section), old
        assert printed(capsys, "list", section) in everything.replace("\n  ", "\n")


def failing_command(error: Exception, module: str):
    """A ``redco zoo run`` whose pipeline raises ``error`` from code of module ``module``."""
    namespace = {"__name__": module, "error": error}
    exec("def run(args):\n    raise error\n", namespace)
    return type("Failing", (), {"description": "fails", "add_arguments": lambda self, p: None,
                                "run": staticmethod(namespace["run"])})()


@pytest.mark.parametrize("module, one_line", [("redco_zoo_lm.pipeline", True),
                                              ("redco.trainer", True), ("numpy.core", False),
                                              ("my_pipeline", False)])
def test_only_redcos_own_value_errors_are_one_line(module, one_line, monkeypatch, capsys):
    monkeypatch.setattr(cli.plugins, "lookup",
                        lambda kind, name: failing_command(ValueError("bad --x 3"), module))
    monkeypatch.delenv("REDCO_DEBUG", raising=False)
    if not one_line:
        with pytest.raises(ValueError, match="bad --x 3"):
            cli.main(["zoo", "run", "anything"])
        return
    line = error_line(capsys, "zoo", "run", "anything")
    assert line.startswith("redco zoo: bad --x 3 (redco --debug"), line
