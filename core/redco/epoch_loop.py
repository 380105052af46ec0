"""The epoch loop: ``fit``'s epochs, and the updates of one epoch (``Trainer.train_epoch``).

One epoch's loop, per update: collate and place the batch (``Deployer.make_batch``), dispatch
the jitted step, and only then read the previous update's metrics back, so the host prepares
batch ``i + 1`` while the device runs update ``i``; the metrics go to the observers one update
behind (``step_reports.report``). After an update the trainer's run is told
(``RunContext.update_done``: in ``fit`` it stops on a signal or saves when due; inside a loop of
rounds it waits for the round's end), then, as asked, it evaluates every ``n`` updates (and stops
there if an observer asked). Every part is timed for the observers
(``data``, ``compile``, ``step``, ``evaluation``, ``checkpoint``).

``fit``'s loop runs those epochs from where it resumed until ``n_epochs``, ``max_steps`` or a
stop, evaluating and saving after each as its plan says (``fit_plan.py``).
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import jax

from redco.data import n_full_batches
from redco.data_order import EpochBatches, Stream, as_stream
from redco.evaluation import Evaluation
from redco.fit_plan import FitOptions, FitPlan
from redco.run_context import RunContext
from redco.step_reports import report, run_update, timed


def train_epochs(trainer: Any, plan: FitPlan, o: FitOptions, run: RunContext) -> None:
    """``fit``'s epochs (``plan``: its ``FitPlan``; ``o``: its ``FitOptions``) on ``run``, from where
    it resumed, until ``n_epochs``, ``max_steps`` or a stop."""
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
                    desc=plan.describe(epoch, o.n_epochs),
                    max_updates=None if last is None else last - trainer.step,
                    evaluate_every=evaluate_every)
        end_epoch(trainer, epoch, plan, run)
        if trainer.stop_reason:
            trainer.deployer.log_info(f"Stopping early: {trainer.stop_reason}")
            break


def end_epoch(trainer: Any, epoch: int, plan: FitPlan, run: RunContext) -> None:
    """After an epoch's updates: evaluate (and keep the best checkpoints), then save the step
    checkpoint if asked."""
    if plan.evaluate is not None and plan.evaluate.last_step != trainer.step:  # (not just done)
        with run.paused(), timed(trainer, "evaluation"):
            plan.evaluate(epoch)
    if plan.save_ckpt:
        run.save(epoch, background=True)


def train_epoch(trainer: Any, examples: Sequence | Iterable, per_device_batch_size: int,
                epoch: int, start_example: int = 0, desc: str = "",
                max_updates: int | None = None,
                evaluate_every: tuple[Evaluation, int] | None = None) -> None:
    """``Trainer.train_epoch``: the updates of ``epoch`` (module docstring), inside the trainer's
    run (``trainer.context``)."""
    run = trainer.context
    batches = epoch_batches(trainer, examples, per_device_batch_size, epoch, start_example,
                            owns_position=run.each_update)
    n_steps = batches.end(max_updates)
    first_step = trainer.step - batches.start  # the step before this epoch's first update
    trainer.hooks.on_epoch_start(trainer=trainer, epoch=epoch, start=batches.start,
                                 n_steps=n_steps, desc=desc, examples_per_step=batches.size)
    pending = None  # the last update's (step, metrics): read once the next is dispatched
    for i, rows in zip(batches.indices(n_steps), batches):
        step = first_step + i + 1
        pending = update(trainer, rows, step, pending)

        def flush() -> None:
            nonlocal pending
            if pending is not None:
                report(trainer, *wait_for(trainer, pending))
                pending = None
        run.update_done(epoch, flush, epoch_ends=i + 1 == n_steps)
        if evaluate_every and step % evaluate_every[1] == 0:
            flush()
            with run.paused(), timed(trainer, "evaluation"):
                evaluate_every[0](epoch, mid_epoch=True)
            if trainer.stop_reason:  # asked by on_eval_end
                break
    if pending is not None:
        report(trainer, *wait_for(trainer, pending))
    trainer.hooks.on_epoch_end(trainer=trainer, epoch=epoch)


def update(trainer: Any, rows: list, step: int, pending: tuple | None) -> tuple[int, dict]:
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


def epoch_batches(trainer: Any, examples: Sequence | Iterable, per_device_batch_size: int,
                  epoch: int, start_example: int, owns_position: bool) -> EpochBatches:
    """``epoch``'s updates from ``start_example`` on (the layout decided at the first);
    ``owns_position``: where it stands is the run's position, saved with its step checkpoints
    (``fit``'s; in a loop of rounds the loop's own state says where it is)."""
    examples = as_stream(examples)
    trainer.prepare(examples.peek(per_device_batch_size)
                    if isinstance(examples, Stream) else examples, per_device_batch_size)
    batch_size = trainer.deployer.get_global_batch_size(per_device_batch_size)
    batch_size *= trainer.accumulate_grad_batches
    if not isinstance(examples, Stream):
        n_full_batches(examples, batch_size, "train_examples")
    batches = EpochBatches(examples, batch_size,
                           lambda n: trainer.deployer.epoch_permutation(n, epoch), start_example)
    if owns_position:
        trainer.checkpoints.batches = (batches, epoch)  # where training stands, saved with them
    return batches


def wait_for(trainer: Any, pending: tuple[int, dict]) -> tuple[int, dict]:
    """``(step, metrics)`` once the device has finished that update (a ``step`` phase)."""
    with timed(trainer, "step", pending[0]):
        return pending[0], jax.device_get(pending[1])
