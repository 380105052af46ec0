"""Multi-turn environments (``redco.protocols.Environment``), a plugin kind: a plugin registers
one with ``register_environments``; ``--environment NAME`` picks it (``load_environment``).

The built-in ``calculator``: the model may end a turn with a call ``<calc>EXPR</calc>``
(integers with ``+ - *`` and parentheses); its turn stops at ``</calc>`` and the environment answers
``<result>VALUE</result>`` (``<result>error</result>`` for what it cannot evaluate), after which
the model goes on. A turn without a call is the final answer: reward 1 when its text, stripped,
is the row's ``answer`` column, else 0. The rollout (``multiturn.py``) ends an episode after
``max_turns`` model turns, a call in the last one earning nothing.
"""
from __future__ import annotations

import ast
import operator
import re
from typing import Callable

from redco import plugins
from redco.protocols import Environment, UsageError

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
CALL = re.compile(r"<calc>((?:(?!<calc>).)*)</calc>\s*$", re.DOTALL)  # the last call, ending it


def evaluate(expression: str) -> int | None:
    """The integer value of ``expression`` (integers, ``+ - *``, unary signs, parentheses), or
    None for anything else: nothing is executed."""
    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in (ast.USub, ast.UAdd):
            return value(node.operand) * (-1 if isinstance(node.op, ast.USub) else 1)
        raise ValueError(ast.dump(node))
    try:
        return value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, RecursionError):
        return None


class Calculator(Environment):
    """The built-in calculator tool (module docstring)."""
    stop = "</calc>"

    def reset(self, row: dict) -> None:
        if "answer" not in row:
            raise UsageError("--environment calculator rewards the final answer against the "
                             f"column 'answer'; the data's rows have only {sorted(row)}: add it.")
        self.answer = str(row["answer"]).strip()

    def step(self, text: str) -> tuple[str | None, float, bool]:
        call = CALL.search(text)
        if call is None:  # the final answer
            return None, float(text.strip() == self.answer), True
        result = evaluate(call.group(1))  # after the last <calc>
        return f"<result>{'error' if result is None else result}</result>", 0.0, False


def load_environment(name: str) -> Callable[[], Environment]:
    """The environment class (or factory) registered as ``name``; an unknown name is refused
    naming the registered ones (``redco.plugins.lookup``)."""
    return plugins.lookup("environments", name)
