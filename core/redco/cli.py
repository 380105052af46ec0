"""The ``redco`` command."""
from __future__ import annotations

import argparse
import json


def cmd_plugins(args) -> None:
    """List loaded plugins, where each comes from, and the hooks it implements."""
    from redco.plugins import list_plugins
    rows = list_plugins()
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    for row in rows:
        print(f"{row['name']:<16} {row['source']:<28} {', '.join(row['hooks'])}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="redco", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    plugins = commands.add_parser("plugins", help=cmd_plugins.__doc__)
    plugins.add_argument("--json", action="store_true", help="print JSON")
    plugins.set_defaults(run=cmd_plugins)
    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
