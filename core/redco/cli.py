"""The ``redco`` command: a thin dispatcher. ``list``, ``launch``, ``new`` and ``zoo`` are here;
plugins add subcommands through ``register_commands`` (``redco-ip``, always installed with redco,
adds ``doctor``; ``redco-planner`` adds ``plan`` and ``rules``), and ``redco launch --launcher
NAME`` offers every registered launcher that submits."""
from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import sys

from redco import plugins, run_config
from redco.cli_parser import Parser
from redco.protocols import LaunchError, UsageError

LISTS = {  # redco list SECTION: its rows, and each row as a line
    "templates": (lambda: [{"name": name, "directory": directory}
                           for name, directory in plugins.registry("templates").items()],
                  lambda row: f"{row['name']:<14} {row['directory']}"),
    "zoo": (lambda: [{"name": name, "description": pipeline.description}
                     for name, pipeline in plugins.registry("zoo_pipelines").items()],
            lambda row: f"{row['name']:<14} {row['description']}"),
    "plugins": (plugins.list_plugins,
                lambda row: f"{row['name']:<16} {row['source']:<28} {', '.join(row['hooks'])}"),
}


def cmd_list(args) -> None:
    """List what is installed: the templates (redco new), the zoo pipelines (redco zoo run) and
    the plugins with the hooks each implements; or one of them."""
    sections = [args.section] if args.section else list(LISTS)
    if args.json:
        rows = {section: LISTS[section][0]() for section in sections}
        print(json.dumps(rows[args.section] if args.section else rows, indent=2))
        return
    for section in sections:
        if not args.section:
            print(f"{section}:")
        line = LISTS[section][1]
        for row in LISTS[section][0]():
            print(line(row) if args.section else f"  {line(row)}")


def add_list(commands) -> None:
    """``redco list [SECTION]``, and the older ``redco plugins`` (``redco list plugins``)."""
    listing = commands.add_parser("list", help=cmd_list.__doc__, description=cmd_list.__doc__)
    listing.add_argument("section", nargs="?", choices=list(LISTS),
                         help="list this only (default: all)")
    listing.add_argument("--json", action="store_true", help="print JSON")
    listing.set_defaults(run=cmd_list)
    older = commands.add_parser("plugins", help="The same as redco list plugins.")
    older.add_argument("--json", action="store_true", help="print JSON")
    older.set_defaults(run=cmd_list, section="plugins")


def add_launch(commands) -> None:
    submitters = {name: ln for name, ln in plugins.registry("launchers").items() if ln.can_submit}
    parser = commands.add_parser(
        "launch", help="Start a command as the processes of one run, with a launcher plugin.",
        usage=f"redco launch --launcher {{{','.join(submitters)}}} [options] -- command ...")
    parser.add_argument("--launcher", required=True, choices=list(submitters))
    for name, launcher in submitters.items():
        launcher.add_arguments(parser.add_argument_group(f"{name}: {launcher.description}"))
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after --")

    def run(args) -> None:
        command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        if not command:
            raise LaunchError(f"no command: put it after `--`, e.g. `redco launch --launcher "
                              f"{args.launcher} ... -- python train.py`")
        sys.exit(submitters[args.launcher].submit(command, args))
    parser.set_defaults(run=run)


def cmd_zoo(args) -> None:
    """Run an installed zoo pipeline: redco zoo run NAME --help (redco list zoo shows them)."""
    if args.action == "list":  # the older spelling of redco list zoo
        return cmd_list(argparse.Namespace(section="zoo", json=False))
    if not args.name:
        raise UsageError("name a pipeline (redco list zoo shows them).")
    pipeline = plugins.lookup("zoo_pipelines", args.name)
    parser = zoo_parser(args.name, pipeline)
    config = _config_path(args.rest)
    if config:
        run_config.apply(parser, run_config.read(config), config)
    pipeline_args = parser.parse_args(args.rest)
    if getattr(pipeline_args, "workdir", None):
        run_config.record(pipeline_args, pipeline_args.workdir, print)
    del pipeline_args.config  # (read here: the pipeline gets its own flags only)
    with _environ("REDCO_LOGGERS", pipeline_args.__dict__.pop("loggers")):
        pipeline.run(pipeline_args)  # every Deployer of the run, and its subprocesses, log to them


def zoo_parser(name: str, pipeline) -> Parser:
    """``redco zoo run NAME``'s flags: the pipeline's own, ``--loggers`` and ``--config``."""
    parser = Parser(prog=f"redco zoo run {name}", description=pipeline.description)
    pipeline.add_arguments(parser)
    everyone = [name for name, logger in plugins.registry("loggers").items()
                if not getattr(logger, "needs_setup", False)]
    parser.add_argument("--loggers", default=",".join(everyone), help="the metric loggers the "
                        f"run writes to, comma-separated (default: {','.join(everyone)}: every "
                        "installed one that needs no account)")
    parser.add_argument("--config", help="a YAML, TOML or JSON file of these settings (the "
                        "flags without dashes); a flag given here wins; what the run resolved "
                        "is written to WORKDIR/run_config.json")
    return parser


def _config_path(argv: list[str]) -> str | None:
    """``--config``'s value in ``argv``, read before the rest (it sets their defaults)."""
    found = argparse.ArgumentParser(add_help=False)
    found.add_argument("--config")
    return found.parse_known_args(argv)[0].config


@contextlib.contextmanager
def _environ(name: str, value: str):
    """``os.environ[name] = value`` for the block, then as it was."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def cmd_new(args) -> None:
    """Write a new project from a template: redco new --template NAME DEST (redco list
    templates shows them)."""
    if args.list or not args.dest:  # --list: the older spelling of redco list templates
        return cmd_list(argparse.Namespace(section="templates", json=False))
    from redco.scaffold import write_project
    dest = write_project(plugins.lookup("templates", args.template), args.dest)
    print(f'wrote {dest}: cd {args.dest} && pip install -e ".[test]" && pytest (see its README.md)')


def build_parser() -> Parser:
    """The ``redco`` command and every subcommand, the plugins' included."""
    parser = Parser(prog="redco", description=__doc__)
    parser.add_argument("--version", action="version",
                        version=f"redco {importlib.metadata.version('redco')}")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of a usage error (or set REDCO_DEBUG=1)")
    commands = parser.add_subparsers(dest="command", required=True)
    add_list(commands)
    add_launch(commands)
    new = commands.add_parser("new", help=cmd_new.__doc__)
    new.add_argument("dest", nargs="?", help="the project's directory (must not exist)")
    new.add_argument("--template", default="minimal")
    new.add_argument("--list", action="store_true", help="the same as redco list templates")
    new.set_defaults(run=cmd_new)
    zoo = commands.add_parser("zoo", help=cmd_zoo.__doc__)
    zoo.add_argument("action", choices=["run", "list"], help="list: the same as redco list zoo")
    zoo.add_argument("name", nargs="?", help="the pipeline to run")
    zoo.add_argument("rest", nargs=argparse.REMAINDER, help="its flags (see --help)")
    zoo.set_defaults(run=cmd_zoo)
    for name, command in plugins.registry("commands").items():
        sub = commands.add_parser(name, help=command.description)
        command.add_arguments(sub)
        sub.set_defaults(run=command.run)
    return parser


def input_error(e: Exception) -> bool:
    """Whether ``e`` is a user's mistake, told in one line: a ``UsageError``, or a ``ValueError``
    that Redco's own code (``redco``, ``redco_*``) raised checking its input; a ``ValueError``
    from elsewhere (jax, numpy, a user's pipeline) may be a bug and keeps its traceback."""
    if isinstance(e, UsageError):
        return True
    frame = e.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    module = frame.tb_frame.f_globals.get("__name__", "") if frame is not None else ""
    return module.partition(".")[0] == "redco" or module.startswith("redco_")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except ValueError as e:  # a user's mistake: one line; other errors keep their traceback
        if args.debug or os.environ.get("REDCO_DEBUG") or not input_error(e):
            raise
        hint = "" if isinstance(e, UsageError) else " (redco --debug ... shows the traceback)"
        print(f"redco {args.command}: {e}{hint}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
