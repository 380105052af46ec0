"""The ``redco`` command's argparse parser: one spelling per flag in ``--help`` and one line per
argument error.

Flags are spelled with underscores (``--per_device_batch_size``), as the Python API names the
same settings. A flag renamed to that rule keeps its old spelling as a hidden alias, given in
the same ``add_argument`` call after the new one: ``add_argument("--seq_len", "--seq-len")``.
``--help`` shows a flag's short options and its first long one only, so the old spelling still
parses and nobody's script breaks, but no one learns it anew."""
from __future__ import annotations

import argparse
import copy
import re

from redco.protocols import did_you_mean


def shown_options(action: argparse.Action) -> list[str]:
    """The option strings of ``action`` that ``--help`` shows: the short ones and the first long
    one; the later long ones are old spellings kept as aliases."""
    if isinstance(action, BooleanFlag):
        return action.shown
    long = [option for option in action.option_strings if option.startswith("--")]
    return [option for option in action.option_strings if not option.startswith("--")] + long[:1]


class BooleanFlag(argparse.Action):
    """``--x`` sets True, ``--no_x`` False (and so does the old ``--no-x`` of argparse's
    ``BooleanOptionalAction``, hidden): ``add_argument("--pack", action=BooleanFlag)``."""

    def __init__(self, option_strings: list[str], dest: str, default=None, help=None):
        names = [option[2:] for option in option_strings]
        self.shown = [*option_strings, *(f"--no_{name}" for name in names)]
        self.negative = {*self.shown[len(names):], *(f"--no-{name}" for name in names)}
        super().__init__([*self.shown, *(f"--no-{name}" for name in names)], dest, nargs=0,
                         default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, option_string not in self.negative)

    def format_usage(self) -> str:
        return " | ".join(self.shown)


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help, each flag under its shown spellings only (no aliases)."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if len(shown_options(action)) == len(action.option_strings):
            return super()._format_action_invocation(action)
        shown = copy.copy(action)
        shown.option_strings = shown_options(action)
        return super()._format_action_invocation(shown)


class Parser(argparse.ArgumentParser):
    """argparse that states an argument error in one line (exit status 2), naming the flag or
    the choice a mistyped one was likely meant to be, and hides the flags' old spellings."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        for action in self._actions:  # argparse names a flag by all its spellings: the shown ones
            if len(shown_options(action)) < len(action.option_strings):
                message = message.replace("/".join(action.option_strings),
                                          "/".join(shown_options(action)))
        self.exit(2, f"{self.prog}: error: {message}{self.hint(message)}\n")

    def hint(self, message: str) -> str:
        """`` (did you mean --x?)`` for a mistyped flag or choice in ``message``, else ``''``."""
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice:
            close = did_you_mean(choice.group(1), re.findall(r"'([^']*)'", choice.group(2)))
            return f" (did you mean {close}?)" if close else ""
        unknown = re.match(r"unrecognized arguments: (.*)", message)
        if not unknown:
            return ""
        flags = self.flags()
        hints = [(typed, close) for typed in unknown.group(1).split()
                 if typed.startswith("-") and (close := did_you_mean(typed.split("=")[0], flags))]
        if len(hints) == 1:
            return f" (did you mean {hints[0][1]}?)"
        return f" (did you mean {', '.join(f'{c} for {t}' for t, c in hints)}?)" if hints else ""

    def flags(self) -> list[str]:
        """Every shown flag of this parser and of its subcommands'."""
        subcommands = [parser for action in self._actions if isinstance(action.choices, dict)
                       for parser in action.choices.values() if isinstance(parser, Parser)]
        return [flag for action in self._actions for flag in shown_options(action)] + \
            [flag for parser in subcommands for flag in parser.flags()]
