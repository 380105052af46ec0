"""Every hook redco calls. A plugin implements any of them with ``@redco.hookimpl``.

Two kinds of hooks:

* ``register_*(register)`` hooks are called once, when the plugin manager builds a registry.
  The plugin calls ``register(name, thing)`` for each thing it provides.
* ``on_*`` lifecycle hooks are called by ``Trainer`` while it runs. Loggers, callbacks such as
  early stopping, and per-run objects passed as ``Trainer(callbacks=[...])`` implement them.
"""
from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("redco")


@hookspec
def register_sharding_rules(register):
    """Called once when the registry of sharding rule sets is first needed.

    Call ``register(name, rule_set)`` for each rule set, a ``redco.protocols.RuleSet``:
    ``rule_set(params, mesh, trace_fn)`` receives a pytree of ``jax.ShapeDtypeStruct``, the
    ``('dp', 'mp')`` mesh and either None or a function ``params -> outputs`` that can be traced
    to see the model's dataflow, and returns a list of ``(regex, PartitionSpec)`` pairs.
    ``Deployer(sharding_rules=name)`` selects one. Returns nothing.
    """


@hookspec
def register_launchers(register):
    """Called once when ``Deployer`` decides how the processes of a run meet, and when
    ``redco launch`` or ``redco doctor`` builds its options.

    Call ``register(name, launcher)`` for each ``redco.protocols.Launcher``. Joining: launchers
    are tried in registration order (third-party before built-in) and the first whose
    ``detect(config)`` is true calls ``initialize(config)``. Submitting: every launcher that
    overrides ``submit`` becomes a choice of ``redco launch --launcher NAME``, with the options
    its ``add_arguments`` adds. Returns nothing.
    """


@hookspec
def register_checkpoint_formats(register):
    """Called once when the registry of checkpoint formats is first needed.

    Call ``register(name, fmt)`` for each ``redco.protocols.CheckpointFormat``:
    ``fmt.save(path, tree)`` is called on every process and writes a pytree of (possibly sharded)
    arrays into the new directory ``path``; ``fmt.load(path, target)`` reads it back into the
    shapes, dtypes and shardings of ``target``. redco adds ``meta.json`` and the atomic rename
    around it. ``Deployer(checkpoint_format=name)`` selects the format that writes; a checkpoint
    is read back by the format that wrote it. Returns nothing.
    """


@hookspec
def register_loggers(register):
    """Called once when ``Deployer`` sets up metric logging.

    Call ``register(name, logger_class)`` for each ``redco.protocols.MetricLogger``:
    ``logger_class(workdir)`` is made on process 0 only and gets ``log(step, metrics)`` and
    ``close()``. ``Deployer(loggers=[...])`` selects which run. Returns nothing.
    """


@hookspec
def register_zoo_pipelines(register):
    """Called once when ``redco zoo`` lists or runs pipelines.

    Call ``register(name, pipeline)`` for each pipeline an installed zoo package provides, a
    ``redco.protocols.Command``: ``description`` (one line), ``add_arguments(parser)`` and
    ``run(args)``. ``redco zoo run NAME ...`` runs one. Returns nothing.
    """


@hookspec
def register_commands(register):
    """Called once when the ``redco`` command line is built.

    Call ``register(name, command)`` for each subcommand a plugin adds, a
    ``redco.protocols.Command``: ``redco NAME ...`` parses the options of
    ``add_arguments(parser)`` and calls ``run(args)``. Returns nothing.
    """


@hookspec
def register_templates(register):
    """Called once when ``redco new`` lists or writes project templates.

    Call ``register(name, directory)`` for each template: a directory of files that
    ``redco new --template NAME DEST`` copies to ``DEST``, replacing ``{{project_name}}`` (the
    destination's name as a Python identifier) in file contents and names. Installing a zoo
    package adds its template this way. Returns nothing.
    """


@hookspec
def register_layout_planners(register):
    """Called once when ``Deployer(n_model_shards="auto")`` decides its layout at the first batch.

    Call ``register(name, planner)`` for each ``redco.protocols.LayoutPlanner``; the one named
    ``"auto"`` is used. Its ``plan(...)`` returns a ``redco.protocols.Layout``. Returns nothing.
    """


@hookspec
def on_fit_start(trainer, n_epochs, steps_per_epoch):
    """Called by ``Trainer.fit`` on every process after the state is placed (and resumed, if a
    checkpoint was found), before the first training step. ``trainer.step`` tells where training
    starts. Returns nothing."""


@hookspec
def on_step_end(trainer, step, metrics):
    """Called after each optimizer update with the update's ``step`` (1-based) and a dict of
    host floats (``loss``, ``grad_norm``, ``lr`` when a schedule is given). Metrics lag the
    device by one step so training never waits on the host. Returns nothing."""


@hookspec
def on_eval_end(trainer, epoch, metrics):
    """Called after the evaluation at the end of each epoch with the eval metrics dict
    (``loss`` and whatever ``eval_metric_fn`` returned). Call ``trainer.request_stop(reason)``
    here to end training early. Returns nothing."""


@hookspec
def on_checkpoint_saved(trainer, path, step):
    """Called on every process after a checkpoint directory ``path`` has been completely and
    atomically written at optimizer step ``step``. Returns nothing."""


@hookspec
def on_fit_end(trainer):
    """Called once when ``Trainer.fit`` finishes, whether all epochs ran or a stop was requested.
    Returns nothing."""
