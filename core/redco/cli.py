"""The ``redco`` command: a thin dispatcher. ``plugins``, ``launch``, ``new`` and ``zoo`` are here;
plugins add subcommands through ``register_commands`` (``redco-ip``, always installed with redco,
adds ``doctor``; ``redco-planner`` adds ``plan`` and ``rules``), and ``redco launch --launcher
NAME`` offers every registered launcher that submits."""
from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import re
import sys

from redco import plugins, run_config
from redco.protocols import LaunchError, UsageError, did_you_mean


class Parser(argparse.ArgumentParser):
    """argparse that names the flag a mistyped one was likely meant to be."""

    def error(self, message: str):
        unknown = re.match(r"unrecognized arguments: (.*)", message)
        if unknown:
            flags = self.flags()
            hints = [(typed, close) for typed in unknown.group(1).split()
                     if typed.startswith("-") and (close := did_you_mean(typed.split("=")[0],
                                                                         flags))]
            if len(hints) == 1:
                message += f" (did you mean {hints[0][1]}?)"
            elif hints:
                message += f" (did you mean {', '.join(f'{c} for {t}' for t, c in hints)}?)"
        super().error(message)

    def flags(self) -> list[str]:
        """Every flag of this parser and of its subcommands'."""
        subcommands = [parser for action in self._actions if isinstance(action.choices, dict)
                       for parser in action.choices.values() if isinstance(parser, Parser)]
        return [flag for action in self._actions for flag in action.option_strings] + \
            [flag for parser in subcommands for flag in parser.flags()]


def cmd_plugins(args) -> None:
    """List loaded plugins, where each comes from, and the hooks it implements."""
    rows = plugins.list_plugins()
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    for row in rows:
        print(f"{row['name']:<16} {row['source']:<28} {', '.join(row['hooks'])}")


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
    """List the installed zoo pipelines, or run one: redco zoo run NAME --help."""
    if args.action == "list":
        for name, pipeline in plugins.registry("zoo_pipelines").items():
            print(f"{name:<14} {pipeline.description}")
        return
    if not args.name:
        raise UsageError("name a pipeline (redco zoo list shows them).")
    pipeline = plugins.lookup("zoo_pipelines", args.name)
    parser = Parser(prog=f"redco zoo run {args.name}", description=pipeline.description)
    pipeline.add_arguments(parser)
    everyone = [name for name, logger in plugins.registry("loggers").items()
                if not getattr(logger, "needs_setup", False)]
    parser.add_argument("--loggers", default=",".join(everyone), help="the metric loggers the "
                        f"run writes to, comma-separated (default: {','.join(everyone)}: every "
                        "installed one that needs no account)")
    parser.add_argument("--config", help="a YAML, TOML or JSON file of these settings (the "
                        "flags without dashes); a flag given here wins; what the run resolved "
                        "is written to WORKDIR/run_config.json")
    config = _config_path(args.rest)
    if config:
        run_config.apply(parser, run_config.read(config), config)
    pipeline_args = parser.parse_args(args.rest)
    if getattr(pipeline_args, "workdir", None):
        run_config.record(pipeline_args, pipeline_args.workdir, print)
    del pipeline_args.config  # (read here: the pipeline gets its own flags only)
    with _environ("REDCO_LOGGERS", pipeline_args.__dict__.pop("loggers")):
        pipeline.run(pipeline_args)  # every Deployer of the run, and its subprocesses, log to them


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
    """Write a new project from a template: redco new --template NAME DEST (--list shows them)."""
    if args.list or not args.dest:
        for name, directory in plugins.registry("templates").items():
            print(f"{name:<14} {directory}")
        return
    from redco.scaffold import write_project
    dest = write_project(plugins.lookup("templates", args.template), args.dest)
    print(f'wrote {dest}: cd {args.dest} && pip install -e ".[test]" && pytest (see its README.md)')


def main(argv: list[str] | None = None) -> None:
    parser = Parser(prog="redco", description=__doc__)
    parser.add_argument("--version", action="version",
                        version=f"redco {importlib.metadata.version('redco')}")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of a usage error (or set REDCO_DEBUG=1)")
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser("plugins", help=cmd_plugins.__doc__)
    listing.add_argument("--json", action="store_true", help="print JSON")
    listing.set_defaults(run=cmd_plugins)
    add_launch(commands)
    new = commands.add_parser("new", help=cmd_new.__doc__)
    new.add_argument("dest", nargs="?", help="the project's directory (must not exist)")
    new.add_argument("--template", default="minimal")
    new.add_argument("--list", action="store_true", help="list the templates")
    new.set_defaults(run=cmd_new)
    zoo = commands.add_parser("zoo", help=cmd_zoo.__doc__)
    zoo.add_argument("action", choices=["list", "run"])
    zoo.add_argument("name", nargs="?", help="the pipeline to run")
    zoo.add_argument("rest", nargs=argparse.REMAINDER, help="its flags (see --help)")
    zoo.set_defaults(run=cmd_zoo)
    for name, command in plugins.registry("commands").items():
        sub = commands.add_parser(name, help=command.description)
        command.add_arguments(sub)
        sub.set_defaults(run=command.run)
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except ValueError as e:  # bad input (UsageError is one): one line; other errors keep
        if args.debug or os.environ.get("REDCO_DEBUG"):  # their traceback
            raise
        hint = "" if isinstance(e, UsageError) else " (redco --debug ... shows the traceback)"
        print(f"redco {args.command}: {e}{hint}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
