"""The epoch loop: ``fit``'s epochs, and the updates of one epoch (``Trainer.train_epoch``).

One epoch's loop, per update: collate and place the batch (``Deployer.make_batch``), dispatch
the jitted step, and only then read the previous update's metrics back, so the host prepares
batch ``i + 1`` while the device runs update ``i``; the metrics go to the observers one update
behind (``step_reports.report``). After an update, as asked: stop on a signal (save, then
``Preempted``), evaluate every ``n`` updates (and stop there if an observer asked), write a step
checkpoint every ``n`` updates (in the background). Every part is timed for the observers
(``data``, ``compile``, ``step``, ``evaluation``, ``checkpoint``).

``fit``'s loop runs those epochs from where it resumed until ``n_epochs``, ``max_steps`` or a
stop, evaluating and saving after each as its plan says (``fit_plan.py``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Sequence

import jax

from redco.data import n_full_batches
from redco.data_order import EpochBatches, Stream, as_stream
from redco.evaluation import Evaluation
from redco.step_reports import report, run_update, timed

if TYPE_CHECKING:  # annotations only (trainer.py imports this module)
    from redco.fit_plan import FitOptions, FitPlan
    from redco.trainer import Trainer


def train_epochs(trainer: Trainer, plan: FitPlan, o: FitOptions) -> None:
    """``fit``'s epochs (``plan``: its ``FitPlan``; ``o``: its ``FitOptions``), from where it
    resumed, until ``n_epochs``, ``max_steps`` or a stop."""
    evaluate_every = o.eval_every_n_steps and (plan.evaluate, o.eval_every_n_steps)
    last = None if o.max_steps is None else plan.done + o.max_steps  # the last update's step
    for epoch in plan.epochs(o.n_epochs):
        if last is not None and trainer.step >= last:
            break
        examples = plan.examples_of(epoch)
        start = plan.start_example(epoch, examples)
        if start is None:  # ended before the checkpoint this run resumed from
            continue
        train_epoch(trainer, examples, o.per_device_batch_size, epoch, start_example=start,
                    save_every_n_steps=o.save_every_n_steps, keep_last_ckpts=o.keep_last_ckpts,
                    desc=plan.describe(epoch, o.n_epochs),
                    max_updates=None if last is None else last - trainer.step,
                    evaluate_every=evaluate_every)
        end_epoch(trainer, epoch, plan, o.keep_last_ckpts)
        if trainer.stop_reason:
            trainer.deployer.log_info(f"Stopping early: {trainer.stop_reason}")
            break


def end_epoch(trainer: Trainer, epoch: int, plan: FitPlan, keep_last_ckpts: int) -> None:
    """After an epoch's updates, with the hang watch paused: evaluate (and keep the best
    checkpoints), save the step checkpoint if asked, and Redco 0.4's per-epoch options."""
    with trainer.hang_watch_paused():
        if plan.evaluate is not None and plan.evaluate.last_step != trainer.step:  # (not just done)
            with timed(trainer, "evaluation"):
                plan.evaluate(epoch)
        if plan.save_ckpt:
            trainer.save_step_ckpt(epoch, keep_last_ckpts, background=True)
        plan.v04.epoch_end(trainer, epoch)


def train_epoch(trainer: Trainer, examples: Sequence | Iterable, per_device_batch_size: int,
                epoch: int, start_example: int = 0, save_every_n_steps: int | None = None,
                keep_last_ckpts: int = 1, desc: str = "", max_updates: int | None = None,
                evaluate_every: tuple[Evaluation, int] | None = None) -> None:
    """``Trainer.train_epoch``: the updates of ``epoch`` (module docstring)."""
    batches = epoch_batches(trainer, examples, per_device_batch_size, epoch, start_example)
    n_steps = batches.end(max_updates)
    first_step = trainer.step - batches.start  # the step before this epoch's first update
    trainer.hooks.on_epoch_start(trainer=trainer, epoch=epoch, start=batches.start,
                                 n_steps=n_steps, desc=desc, examples_per_step=batches.size)
    pending = None  # the last update's (step, metrics): read once the next is dispatched
    for i, rows in zip(batches.indices(n_steps), batches):
        step = first_step + i + 1
        pending = update(trainer, rows, step, pending)
        if trainer.guard is not None and trainer.guard.stop_after(step):
            report(trainer, *wait_for(trainer, pending))
            stop_on_signal(trainer, epoch, step, keep_last_ckpts)
        evaluating = evaluate_every and step % evaluate_every[1] == 0
        saving = save_every_n_steps and step % save_every_n_steps == 0 and i + 1 != n_steps
        if evaluating or saving:
            report(trainer, *wait_for(trainer, pending))
            pending = None
        if evaluating:
            with trainer.hang_watch_paused(), timed(trainer, "evaluation"):
                evaluate_every[0](epoch, mid_epoch=True)
        if saving:
            trainer.save_step_ckpt(epoch, keep_last_ckpts, background=True)
        trainer.checkpoints.announce()
        if evaluating and trainer.stop_reason:  # asked by on_eval_end
            break
    if pending is not None:
        report(trainer, *wait_for(trainer, pending))
    trainer.hooks.on_epoch_end(trainer=trainer, epoch=epoch)
    if trainer.guard is None:  # called outside fit: its checkpoints are written when it returns
        trainer.checkpoints.announce(wait=True)


def update(trainer: Trainer, rows: list, step: int, pending: tuple | None) -> tuple[int, dict]:
    """Update ``step`` on ``rows`` dispatched, then the previous update's (``pending``)
    metrics read back and reported; returns ``(step, metrics)`` of this one, not yet read."""
    trainer.hooks.on_train_batch_start(trainer=trainer, step=step)
    with timed(trainer, "data", step):
        batch = trainer.deployer.make_batch(rows, trainer.collate_fn,
                                            n_micro=trainer.accumulate_grad_batches)
    with timed(trainer, "step" if trainer.steps.first_run else "compile", step), \
            jax.profiler.StepTraceAnnotation("train_step", step_num=step):  # (profiles)
        metrics = run_update(trainer, batch)
        done = pending and (pending[0], jax.device_get(pending[1]))  # waits for it
    if done:
        report(trainer, *done)
    return step, metrics


def epoch_batches(trainer: Trainer, examples: Sequence | Iterable, per_device_batch_size: int,
                  epoch: int, start_example: int) -> EpochBatches:
    """``epoch``'s updates from ``start_example`` on (the layout decided at the first), and
    the position the step checkpoints save."""
    examples = as_stream(examples)
    trainer._decide_layout(examples.peek(per_device_batch_size)
                           if isinstance(examples, Stream) else examples, per_device_batch_size)
    batch_size = trainer.deployer.get_global_batch_size(per_device_batch_size)
    batch_size *= trainer.accumulate_grad_batches
    if not isinstance(examples, Stream):
        n_full_batches(examples, batch_size, "train_examples")
    batches = EpochBatches(examples, batch_size,
                           lambda n: trainer.deployer.epoch_permutation(n, epoch), start_example)
    trainer.checkpoints.batches = (batches, epoch)  # where training stands, saved with them
    return batches


def wait_for(trainer: Trainer, pending: tuple[int, dict]) -> tuple[int, dict]:
    """``(step, metrics)`` once the device has finished that update (a ``step`` phase)."""
    with timed(trainer, "step", pending[0]):
        return pending[0], jax.device_get(pending[1])


def stop_on_signal(trainer: Trainer, epoch: int, step: int, keep_last_ckpts: int) -> None:
    """Save a step checkpoint (where there is a workdir) and raise ``Preempted``."""
    saved = trainer.save_step_ckpt(epoch, keep_last_ckpts) if trainer.deployer.workdir else None
    error = trainer.guard.watch.stopped(step, saved)
    trainer.deployer.log_info(error.reason)
    raise error
