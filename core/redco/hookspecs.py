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

    Call ``register(name, make_rules)`` for each rule set. ``make_rules(params, mesh, trace_fn)``
    receives a pytree of ``jax.ShapeDtypeStruct``, the ``('dp', 'mp')`` mesh and either None or
    a function ``params -> outputs`` that can be traced to see the model's dataflow, and returns
    a list of ``(regex, jax.sharding.PartitionSpec)`` pairs over those axes.
    ``Deployer(sharding_rules=name)`` selects one. Returns nothing.
    """


@hookspec
def register_launchers(register):
    """Called once when ``Deployer`` decides how the processes of a run meet.

    Call ``register(name, launcher)`` for each launcher. A launcher has ``detect(config) -> bool``
    (does this environment, or the ``Deployer`` arguments in ``config``, call for it?) and
    ``initialize(config)`` (join the run, normally through ``jax.distributed.initialize``), and
    may have ``explain(config) -> str`` (why it applies or not, shown by ``redco doctor``).
    Launchers are tried in registration order; ``local`` is the fallback. Returns nothing.
    """


@hookspec
def register_checkpoint_formats(register):
    """Called once when the registry of checkpoint formats is first needed.

    Call ``register(name, fmt)`` for each format. ``fmt.save(path, tree)`` is called on every
    process and writes a pytree of (possibly sharded) arrays into the new directory ``path``;
    ``fmt.load(path, target)`` reads it back into the shapes, dtypes and shardings of ``target``
    (a pytree of ``jax.ShapeDtypeStruct``, possibly a subset of what was saved, e.g. only
    ``params``). ``redco.builtins.checkpoints.host_arrays`` and ``place`` do the gathering and
    the per-shard reading for a format that stores whole arrays. redco adds ``meta.json`` (file
    hashes, shapes) and the atomic rename around it. ``Deployer(checkpoint_format=name)`` selects
    the format that writes; a checkpoint is read back by the format that wrote it. Returns
    nothing.
    """


@hookspec
def register_loggers(register):
    """Called once when ``Deployer`` sets up metric logging.

    Call ``register(name, make_logger)`` for each logger. ``make_logger(workdir)`` returns an
    object with ``log(step: int, metrics: dict[str, float])`` and ``close()``; it is only made
    on process 0. ``Deployer(loggers=[...])`` selects which run. Returns nothing.
    """


@hookspec
def register_zoo_pipelines(register):
    """Called once when ``redco zoo`` lists or runs pipelines.

    Call ``register(name, pipeline)`` for each pipeline an installed zoo package provides. A
    pipeline has ``description`` (one line), ``add_arguments(parser)`` (its command-line flags,
    on an ``argparse.ArgumentParser``) and ``run(args)`` (train and evaluate from the parsed
    flags). ``redco zoo run NAME ...`` runs one. Returns nothing.
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
