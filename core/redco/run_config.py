"""A zoo run's settings in a file: ``redco zoo run NAME --config run.yaml [--flag value ...]``.

The file (YAML, TOML or JSON) holds the pipeline's flags by their names without the dashes
(``learning_rate: 3.0e-4``, ``lora_rank: 8``); a flag given on the command line wins over the
file, and the file over the flag's default. A key that is not one of the pipeline's flags is
refused, naming the closest one. What the run resolved (every flag, from wherever it came) is
written to ``<workdir>/run_config.json``; a rerun in the same workdir (a resume) says in its
log which settings differ from the run before, so a changed learning rate or data path is
never silent.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

from redco.cli_parser import shown_options
from redco.protocols import UsageError, did_you_mean

RESOLVED = "run_config.json"


def read(path: str) -> dict[str, Any]:
    """The settings in ``path`` (``.yaml``/``.yml``, ``.toml`` or ``.json``), a flat mapping."""
    if not os.path.isfile(path):
        raise UsageError(f"--config {path}: no such file.")
    kind = os.path.splitext(path)[1].lower()
    with open(path, "rb") as f:
        if kind in (".yaml", ".yml"):
            import yaml  # (PyYAML comes with transformers and datasets)
            settings = yaml.safe_load(f)
        elif kind == ".toml":
            import tomllib
            settings = tomllib.load(f)
        elif kind == ".json":
            settings = json.load(f)
        else:
            raise UsageError(f"--config {path}: give a .yaml, .toml or .json file.")
    if not isinstance(settings, dict) or any(isinstance(v, dict) for v in settings.values()):
        raise UsageError(f"--config {path}: write flat `name: value` lines, the pipeline's flags "
                         "without their dashes (e.g. learning_rate: 3.0e-4).")
    return settings


def apply(parser: argparse.ArgumentParser, settings: dict[str, Any], path: str) -> None:
    """Make ``settings`` the defaults of ``parser``'s flags (so the command line wins), each
    checked against the flags the parser has."""
    actions = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    flags = {spelling.lstrip("-").replace("-", "_"): a  # any spelling of a flag, or its dest
             for a in actions for spelling in [a.dest, *a.option_strings]}
    for name, value in settings.items():
        key = name.replace("-", "_")
        if key not in flags:
            close = did_you_mean(key, flags)
            known = sorted(shown_options(a)[-1][2:] for a in actions)
            raise UsageError(f"--config {path}: {name!r} is not a setting of this pipeline"
                             + (f" (did you mean {close!r}?)" if close else "") +
                             f". Its settings: {', '.join(known)}.")
        action = flags[key]
        if isinstance(value, str) and action.type is not None:
            value = action.type(value)  # the flag's own conversion, as on the command line
        if action.choices is not None and value not in action.choices:
            raise UsageError(f"--config {path}: {name} {value!r} is not one of "
                             f"{list(action.choices)}.")
        parser.set_defaults(**{action.dest: value})
        action.required = False


def record(args: argparse.Namespace, workdir: str, log) -> None:
    """Write what the run resolved to ``workdir/run_config.json``; where an earlier run wrote
    one, ``log`` the settings that changed since."""
    resolved = {k: v for k, v in sorted(vars(args).items()) if k != "config"}
    path = os.path.join(workdir, RESOLVED)
    if os.path.isfile(path):
        with open(path) as f:
            before = json.load(f)
        changed = [f"{k}: {before.get(k)!r} -> {v!r}" for k, v in resolved.items()
                   if before.get(k) != v]
        if changed:
            log(f"Settings changed since the run before in {workdir}: {'; '.join(changed)}.")
    os.makedirs(workdir, exist_ok=True)
    # a temporary name of this writer's own: every process of a run records the same settings
    # in the same workdir, and a shared ``.tmp`` let one's rename take the other's file away
    fd, tmp = tempfile.mkstemp(prefix=RESOLVED + ".", suffix=".tmp", dir=workdir)
    with os.fdopen(fd, "w") as f:
        json.dump(resolved, f, indent=1, default=str)
    os.replace(tmp, path)
