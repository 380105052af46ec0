"""Verifiable rewards: a user's Python function scores each completion, and what it returns is
checked before it steers an update.

A reward function takes the rollout's prompts, their completions (text, up to the EOS) and the
prompts' other data columns, each a list aligned with the completions, and returns one number
per completion (TRL's signature, so its reward functions work here unchanged)::

    def my_reward(prompts: list, completions: list[str], **columns) -> list[float]: ...

``--reward`` names one: a built-in (``exact_match``, ``regex_match``), ``module:function`` or
``path/to/file.py:function``.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import re
from typing import Callable

import numpy as np

from redco.protocols import UsageError


def exact_match(prompts: list, completions: list[str], answer: list, **_) -> list[float]:
    """1 where the completion, stripped, is the column ``answer`` (stripped), else 0."""
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answer)]


def regex_match(prompts: list, completions: list[str], pattern: list, **_) -> list[float]:
    """1 where the column ``pattern`` (a regular expression) matches the whole completion."""
    return [float(re.fullmatch(p, c.strip()) is not None) for c, p in zip(completions, pattern)]


BUILT_IN = {"exact_match": exact_match, "regex_match": regex_match}


def load_reward_fn(spec: str) -> Callable:
    """The reward function ``spec`` names (module docstring)."""
    if spec in BUILT_IN:
        return BUILT_IN[spec]
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise UsageError(f"--reward {spec}: give a built-in ({', '.join(BUILT_IN)}), "
                         "module:function or path/to/file.py:function.")
    if where.endswith(".py"):
        if not os.path.isfile(where):
            raise UsageError(f"--reward {spec}: no file {where}.")
        module_spec = importlib.util.spec_from_file_location("redco_user_rewards", where)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    if not callable(getattr(module, name, None)):
        raise UsageError(f"--reward {spec}: {where} has no function {name}.")
    return getattr(module, name)


def score(reward_fn: Callable, prompts: list, completions: list[str], columns: dict,
          where: str) -> np.ndarray:
    """``reward_fn``'s rewards of ``completions`` (``where`` names them in errors), checked:
    one finite number per completion."""
    name = getattr(reward_fn, "__name__", repr(reward_fn))
    got = reward_fn(prompts, completions, **columns)
    try:
        rewards = np.asarray(got, np.float64)
    except (TypeError, ValueError) as e:
        raise UsageError(f"The reward function {name} returned {str(got)[:80]!r} for {where}: "
                         "return a list of numbers, one per completion.") from e
    if rewards.shape != (len(completions),):
        raise UsageError(f"The reward function {name} returned shape {rewards.shape} for "
                         f"{len(completions)} completions of {where}: return a list of "
                         f"{len(completions)} numbers, one per completion, in their order.")
    bad = np.flatnonzero(~np.isfinite(rewards))
    if bad.size:
        i = bad[0]
        raise UsageError(f"The reward function {name} returned {rewards[i]} for completion {i} "
                         f"of {where} ({completions[i]!r} after prompt {prompts[i]!r}): return a "
                         "finite number for every completion (e.g. 0 where it earns nothing).")
    return rewards
