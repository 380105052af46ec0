"""What a plugin of each kind must provide, as code. Subclass one of these (or just provide the
same methods); ``redco.plugins`` checks every registered thing against its kind's methods and
refuses one that misses any, with a warning naming the plugin and the method.

* ``register_sharding_rules``: a ``RuleSet``, any callable ``(params, mesh, trace_fn) -> rules``;
* ``register_launchers``: a ``Launcher`` (join: ``detect``, ``initialize``, ``explain``;
  submit: ``add_arguments``, ``submit``);
* ``register_checkpoint_formats``: a ``CheckpointFormat`` (``save``, ``load``);
* ``register_loggers``: a ``MetricLogger`` class, or a factory of them (``log``, ``close``);
* ``register_zoo_pipelines`` and ``register_commands``: a ``Command`` (``description``,
  ``add_arguments``, ``run``);
* ``register_templates``: the path of an existing directory;
* ``register_layout_planners``: a ``LayoutPlanner`` (``plan``);
* ``register_environments``: an ``Environment`` class or factory (``stop``, ``reset``, ``step``);
* ``register_observers``: a class (or factory) called as ``cls(trainer)`` once per ``Trainer``,
  whose instance implements lifecycle hooks (``redco/hookspecs.py``; ``redco/observers/``).
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
from typing import Any, Callable, NamedTuple

Rules = list  # [(regex, jax.sharding.PartitionSpec), ...]; see redco.sharding


class UsageError(ValueError):
    """A mistake in how redco was called (an unknown name, a missing file, a bad flag), with
    what to do instead: the ``redco`` command prints it in one line and exits 2 (``--debug``
    or ``REDCO_DEBUG=1`` shows the traceback). A ``ValueError``, as the library's other
    refusals of bad input are."""


def did_you_mean(typed: str, known) -> str | None:
    """The one of the names ``known`` that a mistyped ``typed`` was most likely meant to be, for
    a usage error's "did you mean ...?"; ``None`` when none is close."""
    close = difflib.get_close_matches(typed, list(known), 1, 0.6)
    return close[0] if close else None


class LaunchError(UsageError):
    """A launch that cannot work, with what to do instead."""


class NotRegistered(UsageError, ValueError):
    """No plugin of a kind has the name asked for."""


class RuleSet:
    """``rule_set(params, mesh, trace_fn) -> Rules``: ``params`` a pytree of
    ``jax.ShapeDtypeStruct``, ``mesh`` the ``('dp', 'mp')`` mesh, ``trace_fn`` None or
    ``params -> outputs`` to trace for the model's dataflow. A plain function will do."""

    def __call__(self, params: Any, mesh: Any, trace_fn: Callable | None = None) -> Rules:
        raise NotImplementedError


class Launcher:
    """How the processes of a run meet (join) and how a run is started (submit). A launcher may do
    either or both: the defaults here say "not mine" and "cannot submit".

    Joining (``Deployer`` calls these; ``config`` holds the Deployer's ``n_processes``,
    ``host0_address``, ``host0_port``, ``process_id`` and ``n_local_devices``):

    * ``detect(config) -> bool``: does this environment (or ``config``) call for this launcher?
      Launchers are tried in registration order; third-party ones before the built-ins.
    * ``initialize(config)``: join the run, normally through ``jax.distributed.initialize``.
    * ``explain(config) -> str``: why it applies or not (``redco doctor`` prints it).

    Submitting (``redco launch --launcher NAME [options] -- command ...``):

    * ``add_arguments(group)``: the launcher's options, on an ``argparse`` argument group.
    * ``submit(command, args) -> int``: start ``command`` (a list of strings) as the processes
      of one run; return an exit code. Raise ``LaunchError`` for a launch that cannot work.

    ``description`` (one line) titles the launcher's options in ``redco launch --help``.
    """
    description: str = ""

    def detect(self, config: dict) -> bool:
        return False

    def initialize(self, config: dict) -> None:
        raise RuntimeError(f"{type(self).__name__} cannot join a run.")

    def explain(self, config: dict) -> str:
        return "does not join runs (a submitter only)"

    def add_arguments(self, group: argparse._ArgumentGroup) -> None:
        pass

    def submit(self, command: list[str], args: argparse.Namespace) -> int:
        raise LaunchError(f"{type(self).__name__} joins runs but cannot start one.")

    @property
    def can_submit(self) -> bool:
        return type(self).submit is not Launcher.submit


class CheckpointFormat:
    """Writes a pytree of (possibly sharded) arrays to a new directory and reads it back onto
    any shardings. ``redco.checkpointing`` adds ``meta.json`` and the atomic rename around it,
    and has helpers for formats that store whole arrays (``host_arrays``, ``place``)."""

    def save(self, path: str, tree: Any) -> None:
        """Called on every process; write ``tree`` into the new directory ``path``."""
        raise NotImplementedError

    def load(self, path: str, target: Any) -> Any:
        """Read ``path`` into the shapes, dtypes and shardings of ``target`` (a pytree of
        ``jax.ShapeDtypeStruct``, possibly a subset of what was saved)."""
        raise NotImplementedError

    # Optional, for saves in the background (step checkpoints while training goes on):
    # ``start_save(path, tree)`` is called on every process's training thread, copies what this
    # process writes of ``tree`` to host memory (device collectives may run there) and returns
    # ``finish()``, which a writer thread calls to write it into ``path``: with no device
    # collective (training runs its own meanwhile), only what the coordination service offers.
    # Without it (None), the whole arrays are copied to every process's host and ``finish``
    # calls ``save`` with them: right for a format whose ``save`` of host arrays runs no
    # collective (``safetensors``, ``msgpack``: process 0 writes it all).
    start_save: Callable[[str, Any], Callable[[], None]] | None = None


class MetricLogger:
    """Made as ``logger_class(workdir, **options)`` on process 0 only; ``options`` are what the
    ``Deployer`` was given for this logger (``wandb_init_kwargs`` for ``wandb``), usually none.
    ``redco zoo run`` writes to every installed logger but those with ``needs_setup`` (an
    account, a project), which run only when named."""

    needs_setup: bool = False

    def __init__(self, workdir: str, **options):
        self.workdir = workdir

    def log(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def forget_after(self, step: int) -> None:
        """Optional. The run resumed from its checkpoint at ``step``: the steps after it are
        logged again, so drop what was logged for them."""

    def close(self) -> None:
        pass


class Command:
    """A ``redco`` subcommand (``register_commands``) or a zoo pipeline (``redco zoo run NAME``)."""
    description: str = ""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        pass

    def run(self, args: argparse.Namespace) -> Any:
        raise NotImplementedError


class Layout(NamedTuple):
    """A decided layout: the model-parallel degree, the rule set's name, its rules, the
    ``redco.remat`` policy the train step was planned with (None where no planner chose), the
    context-parallel degree (devices
    splitting each sequence), and the planner's report (every layout it tried; None where no
    planner chose)."""
    n_model_shards: int
    sharding_rules: str
    rules: Rules
    remat: str | None = "none"
    n_context_shards: int = 1
    report: Any = None


@dataclasses.dataclass(frozen=True)
class LayoutRequest:
    """What a layout planner is asked: ``loss(params, batch) -> scalar`` with ``batch`` one
    device's abstract rows; the trainer's step ``settings`` (``redco.step_settings``: optimizer,
    remat, trainable mask, micro-batches); and, from the deployer, the ``rule_sets`` to try and
    the ``n_model_shards`` / ``n_context_shards`` to choose among (None: any)."""
    params: Any
    loss: Callable
    batch: Any
    settings: Any
    rule_sets: tuple[str, ...] = ("auto",)
    model_degrees: tuple[int, ...] | None = None
    context_degrees: tuple[int, ...] | None = (1,)

    def replace(self, **changes) -> LayoutRequest:
        return dataclasses.replace(self, **changes)


class LayoutPlanner:
    """Picks the layout for ``Deployer(n_model_shards="auto")`` or ``n_context_shards="auto"``
    (registered as ``"auto"``)."""

    def plan(self, deployer: Any, request: LayoutRequest) -> Layout:
        """Try ``request.rule_sets`` over the deployer's devices and return the layout to use.
        With ``request.settings.remat`` None the planner picks the policy (``Layout.remat``);
        ``settings.trainable`` (LoRA): frozen leaves take no gradient or optimizer state.
        (Planners written for ``plan(deployer, params, loss, batch, optimizer, rule_sets,
        ...)`` are still called so: ``redco.compat.ask_planner``.)"""
        raise NotImplementedError


class Environment:
    """A multi-turn environment: the model's turns end at ``stop`` (a tool call's end tag) or at
    its end of turn; one instance per trajectory, made without arguments.

    * ``reset(row)``: a new episode for the data row ``row`` (a dict: its prompt and columns).
    * ``step(text) -> (observation, reward, done)``: ``text`` is the model's last turn, decoded;
      ``observation`` the environment's text appended after it (tokenised once, never counted
      by the loss), None when ``done``; ``reward`` a number, summed over the episode.
    """
    stop: str = ""

    def reset(self, row: dict) -> None:
        raise NotImplementedError

    def step(self, text: str) -> tuple[str | None, float, bool]:
        raise NotImplementedError


# kind (the hook's name without register_) -> the methods a registered thing must have
REQUIRED = {
    "sharding_rules": ("__call__",),
    "launchers": ("detect", "initialize", "explain", "add_arguments", "submit"),
    "checkpoint_formats": ("save", "load"),
    "loggers": ("log", "close"),
    "zoo_pipelines": ("description", "add_arguments", "run"),
    "commands": ("description", "add_arguments", "run"),
    "layout_planners": ("plan",),
    "environments": ("stop", "reset", "step"),
}


def missing(kind: str, thing: Any) -> list[str]:
    """What ``thing`` lacks to be a plugin of ``kind`` (empty when it is complete)."""
    if kind == "templates":
        return [] if isinstance(thing, (str, os.PathLike)) and os.path.isdir(thing) else \
            [f"an existing directory (got {thing!r})"]
    if kind == "loggers" and not isinstance(thing, type):
        return [] if callable(thing) else ["__call__"]  # a factory: its loggers are checked made
    if kind == "observers":
        return [] if callable(thing) else ["__call__ (a class or factory taking the trainer)"]
    return [name for name in REQUIRED.get(kind, ()) if not hasattr(thing, name)]
