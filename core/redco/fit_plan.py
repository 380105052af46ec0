"""What ``Trainer.fit`` decides before its first update: its numbers checked, the evaluation
planned (metric names checked before anything compiles), the layout and the updates per epoch,
the profile window, plugin state checked, resume, the sanity check. Every mistake that can be
known before training fails here, before anything already saved is touched."""
from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any, Callable, Sequence

from redco import compat
from redco.data import check_number, n_full_batches
from redco.evaluation import Evaluation
from redco.observers.profiler import profile_window


@dataclasses.dataclass
class FitPlan:
    first_examples: Sequence  # epoch 0's
    done: int  # updates made before this fit's first epoch
    examples_per_step: int
    steps_per_epoch: int
    evaluate: Evaluation | None
    save_ckpt: bool  # a step checkpoint after each epoch
    fit_options: dict  # for the observers' ``on_fit_start``
    v04: compat.FitOptionsV04


def check_fit_numbers(n_epochs, keep_last_ckpts, save_every_n_steps, eval_per_device_batch_size,
                      per_device_batch_size) -> None:
    """``fit``'s counts: each a positive int (the two that may be left out: or None)."""
    check_number("n_epochs", n_epochs, 1)
    check_number("keep_last_ckpts", keep_last_ckpts, 1)
    check_number("save_every_n_steps", save_every_n_steps, 1, optional=True)
    check_number("eval_per_device_batch_size", eval_per_device_batch_size, 1, optional=True)
    check_number("per_device_batch_size", per_device_batch_size, 1)


def plan_fit(trainer, train_examples: Sequence | Callable, per_device_batch_size: int,
             n_epochs: int, eval_examples, eval_per_device_batch_size, eval_loss, eval_predictor,
             eval_metric_fn, save_last_ckpt, save_argmin_ckpt_by_metrics,
             save_argmax_ckpt_by_metrics, save_every_n_steps, keep_last_ckpts, resume,
             eval_sanity_check, profile_steps, v04_options: dict[str, Any]) -> FitPlan:
    """``fit``'s arguments checked and its run decided, in that order (see the module), for
    ``trainer`` (a ``Trainer``)."""
    started, v04 = time.perf_counter(), compat.FitOptionsV04(**v04_options)
    check_fit_numbers(n_epochs, keep_last_ckpts, save_every_n_steps, eval_per_device_batch_size,
                      per_device_batch_size)
    first_examples = compat.examples_of_epoch(train_examples, 0)
    done = trainer.step if trainer._fitted else 0
    workdir = trainer.deployer.workdir
    profile_window(profile_steps, done + 1, None, workdir)  # before placing anything
    evaluate = Evaluation.plan(
        trainer, eval_examples, eval_per_device_batch_size or per_device_batch_size, eval_loss,
        eval_predictor, eval_metric_fn,
        [*(save_argmin_ckpt_by_metrics or ()), *(save_argmax_ckpt_by_metrics or ())],
        check_names=eval_sanity_check)
    examples_per_step, steps_per_epoch = plan_steps(trainer, first_examples,
                                                    per_device_batch_size, n_epochs)
    window = profile_window(profile_steps, done + 1, done + n_epochs * steps_per_epoch, workdir)
    fit_options = {"save_argmin_ckpt_by_metrics": save_argmin_ckpt_by_metrics,
                   "save_argmax_ckpt_by_metrics": save_argmax_ckpt_by_metrics,
                   "profile_window": window}
    trainer.hooks.saved_state(trainer, trainer.step)  # a plugin's bad state fails now
    save_ckpt = save_last_ckpt or bool(save_every_n_steps)
    if not trainer._fitted:
        trainer.checkpoints.start(resume, saves=save_ckpt)
    if evaluate is not None and eval_sanity_check:
        evaluate.sanity_check()
    trainer.hooks.on_time_spent(trainer=trainer, phase="startup", step=None,
                                seconds=time.perf_counter() - started)
    return FitPlan(first_examples, done, examples_per_step, steps_per_epoch, evaluate, save_ckpt,
                   fit_options, v04)


def plan_steps(trainer, first_examples: Sequence, per_device_batch_size: int,
               n_epochs: int) -> tuple[int, int]:
    """Decide the layout on the first examples; ``(examples per update, updates per epoch)``.
    Warns when the lr schedule spans another number of updates than this fit makes."""
    trainer._decide_layout(first_examples, per_device_batch_size)
    batch_size = trainer.deployer.get_global_batch_size(per_device_batch_size)
    examples_per_step = batch_size * trainer.accumulate_grad_batches
    steps_per_epoch = n_full_batches(len(first_examples), examples_per_step, "train_examples")
    total = getattr(trainer.lr_schedule_fn, "total_steps", None)
    if total is not None and total != n_epochs * steps_per_epoch:
        warnings.warn(
            f"The lr schedule spans {total} updates but this fit makes "
            f"{n_epochs * steps_per_epoch}, so it will not end at its end value. Pass "
            f"accumulate_grad_batches={trainer.accumulate_grad_batches} (and the same batch size "
            "and epochs) to deployer.get_lr_schedule_fn.", stacklevel=4)
    trainer.checkpoints.data_position = {"n_examples": len(first_examples),
                                         "jax_seed": trainer.deployer.jax_seed,
                                         "examples_per_step": examples_per_step}
    source = getattr(first_examples, "fingerprint", None)  # what the examples are made of
    if source is not None:
        trainer.checkpoints.data_position["source"] = str(source)
    return examples_per_step, steps_per_epoch
