"""Every hook redco calls. A plugin implements any of them with ``@redco.hookimpl``.

* ``register_*(register)`` hooks are called once, when the plugin manager builds a registry; the
  plugin calls ``register(name, thing)`` for each thing it provides. What a thing of each kind
  must have is code, in ``redco.protocols``; a thing missing a method is refused.
* ``on_*`` hooks are called by ``Trainer`` while it runs: loggers, early stopping and objects
  passed as ``Trainer(callbacks=[...])`` implement them.
"""
from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("redco")


@hookspec
def register_sharding_rules(register):
    """Called once, when ``Deployer`` first looks up a rule set. Register each
    ``protocols.RuleSet``; ``Deployer(sharding_rules=name)`` selects one. Returns nothing."""


@hookspec
def register_launchers(register):
    """Called once, when ``Deployer`` joins the run or ``redco launch``/``doctor`` builds its
    options. Register each ``protocols.Launcher``: the first (in registration order, third-party
    before built-in) whose ``detect`` is true joins the run; each that can ``submit`` becomes a
    ``redco launch --launcher NAME`` choice. Returns nothing."""


@hookspec
def register_checkpoint_formats(register):
    """Called once, when a checkpoint is first written or read. Register each
    ``protocols.CheckpointFormat``; ``Deployer(checkpoint_format=name)`` picks the writer, and a
    checkpoint is read by the format that wrote it. Returns nothing."""


@hookspec
def register_loggers(register):
    """Called once, when ``Deployer`` sets up logging. Register each ``protocols.MetricLogger``
    class (made on process 0 only); ``Deployer(loggers=[...])`` selects them. Returns nothing."""


@hookspec
def register_zoo_pipelines(register):
    """Called once, when ``redco zoo`` lists or runs pipelines. Register each pipeline of an
    installed zoo package, a ``protocols.Command``; ``redco zoo run NAME`` runs it. Returns
    nothing."""


@hookspec
def register_commands(register):
    """Called once, when the ``redco`` command line is built. Register each subcommand, a
    ``protocols.Command``: ``redco NAME ...`` parses its arguments and calls ``run(args)``.
    Returns nothing."""


@hookspec
def register_templates(register):
    """Called once, when ``redco new`` lists or writes templates. Register each template: a
    directory that ``redco new --template NAME DEST`` copies, replacing ``{{project_name}}`` in
    file contents and names. Returns nothing."""


@hookspec
def register_layout_planners(register):
    """Called once, when ``Deployer(n_model_shards="auto")`` decides its layout at the first
    batch. Register each ``protocols.LayoutPlanner``; the one named ``"auto"`` is used. Returns
    nothing."""


@hookspec
def on_fit_start(trainer, n_epochs, steps_per_epoch):
    """Called by ``Trainer.fit`` on every process once the state is placed (and resumed), before
    the first step; ``trainer.step`` tells where training starts. Returns nothing."""


@hookspec
def on_step_end(trainer, step, metrics):
    """Called after each optimizer update with its ``step`` (1-based) and host floats (``loss``,
    ``grad_norm``, ``lr``), one step behind the device so training never waits. Returns nothing."""


@hookspec
def on_eval_end(trainer, epoch, metrics):
    """Called after each epoch's evaluation with its metrics (``loss`` and what ``eval_metric_fn``
    returned); ``trainer.request_stop(reason)`` here ends training early. Returns nothing."""


@hookspec
def on_checkpoint_saved(trainer, path, step):
    """Called on every process once checkpoint ``path`` (step ``step``) is completely and
    atomically written. Returns nothing."""


@hookspec
def on_fit_end(trainer):
    """Called once when ``Trainer.fit`` finishes, all epochs run or a stop requested. Returns
    nothing."""
