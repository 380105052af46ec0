"""Every hook redco calls. A plugin implements any of them with ``@redco.hookimpl``.

* ``register_*(register)`` hooks are called once, when the plugin manager builds a registry; the
  plugin calls ``register(name, thing)`` for each thing it provides. What a thing of each kind
  must have is code, in ``redco.protocols``; a thing missing a method is refused.
* ``on_*`` hooks (and ``collect_step_metrics``, ``state_to_save``) are called by ``Trainer``
  while it runs. Each Trainer calls them on its own observers first: one instance of every
  class registered by ``register_observers`` (the built-in progress bar, metric logging,
  throughput, goodput, profiler and best checkpoints among them) and the objects passed as
  ``Trainer(callbacks=[...])``; then on the plugins of the process-wide plugin manager. Two
  Trainers in one process never see each other's observers.
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
def register_environments(register):
    """Called once, when a multi-turn rollout (``redco zoo run grpo --environment NAME``) looks
    up its environment. Register each ``protocols.Environment`` class (or factory): one is made
    per trajectory. Returns nothing."""


@hookspec
def register_observers(register):
    """Called once per ``Trainer``, when it is made. Register each observer class: the Trainer
    makes one instance, ``cls(trainer)``, and calls the ``on_*`` hooks it implements on it
    (module docstring). The first registration of a name wins, so a plugin replaces a built-in
    observer by registering its name. Returns nothing."""


@hookspec
def on_fit_start(trainer, n_epochs, steps_per_epoch, fit_options):
    """Called by ``Trainer.fit`` on every process once the state is placed (and resumed), before
    the first step; ``trainer.step`` tells where training starts. ``fit_options`` holds fit's
    ``save_argmin_ckpt_by_metrics`` and ``save_argmax_ckpt_by_metrics``, and ``profile_window``:
    the updates to profile, ``(start, stop)`` from ``profile_steps`` or
    ``$REDCO_PROFILE_STEPS``, or None. Returns nothing."""


@hookspec
def on_epoch_start(trainer, epoch, start, n_steps, desc, examples_per_step):
    """Called by ``train_epoch`` before the updates of ``epoch`` (0-based), which has
    ``n_steps`` updates of ``examples_per_step`` examples and resumes at its ``start``-th;
    ``desc`` names it for display. Returns nothing."""


@hookspec
def on_train_batch_start(trainer, step):
    """Called before the batch of update ``step`` (1-based) is collated. Returns nothing."""


@hookspec
def on_time_spent(trainer, phase, seconds, step):
    """Called after each timed phase of training with its wall time: ``"startup"`` (fit's
    checks, layout, placement, resume and sanity check), ``"compile"`` (the first update after
    the step is made, compiled or loaded), ``"data"`` (collating and placing a batch),
    ``"step"`` (dispatching an update and waiting for the previous one's metrics),
    ``"checkpoint"`` or ``"evaluation"``. ``step`` is the update a ``data``, ``compile`` or
    ``step`` phase belongs to, else None. Returns nothing."""


@hookspec
def collect_step_metrics(trainer, step, metrics):
    """Called after each update's metrics reach the host, before they are logged. Returns a
    dict of more metrics to log with them (e.g. throughput), or None."""


@hookspec
def on_step_end(trainer, step, metrics):
    """Called after each optimizer update with its ``step`` (1-based) and host floats (``loss``,
    ``grad_norm``, ``lr``, and what ``collect_step_metrics`` added), one step behind the device
    so training never waits. Returns nothing."""


@hookspec
def on_epoch_end(trainer, epoch):
    """Called by ``train_epoch`` after the last update of ``epoch``. Returns nothing."""


@hookspec
def on_eval_end(trainer, epoch, metrics):
    """Called after each epoch's evaluation, and each one every ``eval_every_n_steps`` updates
    (in ``epoch``; ``trainer.step`` tells after which update), with its metrics (``loss`` and
    what ``eval_metric_fn`` returned); ``trainer.request_stop(reason)`` here ends training
    early. Returns nothing."""


@hookspec
def on_checkpoint_saved(trainer, path, step):
    """Called on every process once checkpoint ``path`` (step ``step``) is completely and
    atomically written: for a step checkpoint written in the background, on the training
    thread at the first update after, with the hang watch paused. Returns nothing."""


@hookspec
def state_to_save(trainer, step):
    """Called on every process when a step checkpoint of ``step`` is written, and once at fit's
    start to check it. Returns a dict of JSON-serialisable state to keep in the checkpoint (e.g.
    the best metric so far), or None. Its keys are the plugin's: two plugins returning the same
    key is an error."""


@hookspec
def on_resume(trainer, step, state):
    """Called on every process when fit resumes from the step checkpoint of ``step``, with
    ``state``: every key ``state_to_save`` returned when it was written. Returns nothing."""


@hookspec
def on_run_start(trainer, resumed_from):
    """Called once when a ``trainer.run()`` (a loop that is not ``fit``) has resumed, from step
    checkpoint ``resumed_from`` (None: a fresh start), and is about to run the loop. Returns
    nothing."""


@hookspec
def on_run_end(trainer):
    """Called once when a ``trainer.run()`` ends: the loop done, stopped by a signal or failed.
    Returns nothing."""


@hookspec
def on_fit_end(trainer):
    """Called once when ``Trainer.fit`` finishes, all epochs run or a stop requested. Returns
    nothing."""
