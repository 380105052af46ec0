"""What ``Trainer.fit`` decides before its first update: its numbers checked, the evaluation
planned (metric names checked before anything compiles), the layout and the updates per epoch,
the profile window, plugin state checked, resume, the sanity check. Every mistake that can be
known before training fails here, before anything already saved is touched."""
from __future__ import annotations

import dataclasses
import itertools
import time
import warnings
from typing import Any, Callable, Iterable, Sequence

from redco import compat, permutation
from redco.data import check_number, n_full_batches
from redco.data_order import Stream, as_stream, position_of
from redco.evaluation import Evaluation
from redco.observers.profiler import profile_window
from redco.protocols import UsageError


@dataclasses.dataclass
class FitPlan:
    train_examples: Sequence | Callable | Stream
    first_examples: Sequence  # epoch 0's (a stream: its first batch)
    done: int  # updates made before this fit's first epoch
    examples_per_step: int
    steps_per_epoch: int | None  # None: a stream
    position: dict  # where this fit starts: {"epoch", "examples"} (redco/data_order.py)
    evaluate: Evaluation | None
    save_ckpt: bool  # a step checkpoint after each epoch
    fit_options: dict  # for the observers' ``on_fit_start``
    v04: compat.FitOptionsV04
    started: float  # perf_counter() when fit began: its startup time is logged

    def epochs(self, n_epochs: int | None) -> Iterable[int]:
        """The epochs this fit trains, from the one it resumes in (a stream: one)."""
        first = self.position["epoch"]
        if isinstance(self.train_examples, Stream):
            return range(first, first + 1)
        return itertools.count(first) if n_epochs is None else range(first, n_epochs)

    def examples_of(self, epoch: int) -> Sequence | Stream:
        """The examples ``epoch`` trains on."""
        if isinstance(self.train_examples, Stream):
            return self.train_examples
        return self.first_examples if epoch == 0 else \
            compat.examples_of_epoch(self.train_examples, epoch)

    def start_example(self, epoch: int, examples: Sequence | Stream) -> int | None:
        """Examples of ``epoch``'s order trained on before this fit; None: all of them."""
        if epoch != self.position["epoch"]:
            return 0
        done = self.position["examples"]
        return None if not isinstance(examples, Stream) and done >= len(examples) else done

    def describe(self, epoch: int, n_epochs: int | None) -> str:
        """``epoch``'s name on the progress bar."""
        if isinstance(self.train_examples, Stream):
            return "stream"
        return f"epoch {epoch + 1}" + ("" if n_epochs is None else f"/{n_epochs}")


def check_fit_numbers(n_epochs, max_steps, keep_last_ckpts, save_every_n_steps,
                      eval_per_device_batch_size, per_device_batch_size,
                      eval_every_n_steps, max_eval_batches=None) -> None:
    """``fit``'s counts: each a positive int (those that may be left out: or None)."""
    check_number("n_epochs", n_epochs, 1, optional=True)
    check_number("max_steps", max_steps, 1, optional=True)
    check_number("eval_every_n_steps", eval_every_n_steps, 1, optional=True)
    check_number("max_eval_batches", max_eval_batches, 1, optional=True)
    check_number("keep_last_ckpts", keep_last_ckpts, 1)
    check_number("save_every_n_steps", save_every_n_steps, 1, optional=True)
    check_number("eval_per_device_batch_size", eval_per_device_batch_size, 1, optional=True)
    check_number("per_device_batch_size", per_device_batch_size, 1)


def check_length(train_examples, n_epochs: int | None, max_steps: int | None,
                 saves: bool) -> None:
    """Refuse a fit that does not say how long to train, a stream with epochs, or step
    checkpoints of a stream that cannot tell its position."""
    if isinstance(train_examples, Stream):
        if max_steps is None or n_epochs is not None:
            raise UsageError(
                "train_examples is a stream (an iterator, with no length), which has no epochs: "
                "say how many updates to train for with fit(..., max_steps=N) and no n_epochs.")
        if saves and not train_examples.saves_state:
            raise UsageError(
                "Step checkpoints were asked for, but train_examples is an iterator without "
                "get_state() and set_state() (e.g. a generator): a checkpoint could not say where "
                "in it training was, so a resume would repeat or skip data. Pass an iterator that "
                "has them (a Grain DatasetIterator does), or a random-access sequence.")
    elif n_epochs is None and max_steps is None:
        raise UsageError("Say how long to train: fit(..., n_epochs=N) for N passes over "
                         "train_examples, or max_steps=N for N updates (or both: whichever "
                         "ends first).")


@dataclasses.dataclass(frozen=True)
class FitOptions:
    """``Trainer.fit``'s arguments, by name (see its docstring)."""
    train_examples: Sequence | Callable | Iterable
    per_device_batch_size: int
    n_epochs: int | None = None
    max_steps: int | None = None
    eval_examples: Sequence | None = None
    eval_per_device_batch_size: int | None = None
    eval_loss: bool = True
    eval_predictor: Any = None
    eval_metric_fn: Callable | None = None
    save_last_ckpt: bool = False
    save_argmin_ckpt_by_metrics: Sequence[str] | None = None
    save_argmax_ckpt_by_metrics: Sequence[str] | None = None
    save_every_n_steps: int | None = None
    keep_last_ckpts: int = 1
    resume: bool = True
    eval_sanity_check: bool = True
    profile_steps: tuple[int, int] | None = None
    eval_every_n_steps: int | None = None
    max_eval_batches: int | None = None
    v04_options: dict[str, Any] = dataclasses.field(default_factory=dict)


def plan_fit(trainer, o: FitOptions) -> FitPlan:
    """``fit``'s arguments checked and its run decided, in that order (see the module), for
    ``trainer`` (a ``Trainer``); where it starts is known once its run has resumed (``start``)."""
    started, v04 = time.perf_counter(), compat.FitOptionsV04(**o.v04_options)
    check_fit_numbers(o.n_epochs, o.max_steps, o.keep_last_ckpts, o.save_every_n_steps,
                      o.eval_per_device_batch_size, o.per_device_batch_size, o.eval_every_n_steps,
                      o.max_eval_batches)
    if o.eval_every_n_steps and o.eval_examples is None:
        raise UsageError(f"eval_every_n_steps={o.eval_every_n_steps} but no eval_examples: pass "
                         "the examples to evaluate on.")
    train_examples = as_stream(o.train_examples)
    save_ckpt = o.save_last_ckpt or bool(o.save_every_n_steps)
    check_length(train_examples, o.n_epochs, o.max_steps, save_ckpt)
    first_examples = train_examples.peek(o.per_device_batch_size) if isinstance(
        train_examples, Stream) else compat.examples_of_epoch(train_examples, 0)
    done = trainer.step if trainer.fitted else 0
    workdir = trainer.deployer.workdir
    profile_window(o.profile_steps, done + 1, None, workdir)  # before placing anything
    evaluate = Evaluation.plan(
        trainer, o.eval_examples, o.eval_per_device_batch_size or o.per_device_batch_size, o.eval_loss,
        o.eval_predictor, o.eval_metric_fn,
        [*(o.save_argmin_ckpt_by_metrics or ()), *(o.save_argmax_ckpt_by_metrics or ())],
        check_names=o.eval_sanity_check, max_batches=o.max_eval_batches)
    examples_per_step, steps_per_epoch = plan_steps(trainer, train_examples, first_examples,
                                                    o.per_device_batch_size, o.n_epochs, o.max_steps)
    window = profile_window(o.profile_steps, done + 1,
                            done + n_updates(o.n_epochs, steps_per_epoch, o.max_steps), workdir)
    fit_options = {"save_argmin_ckpt_by_metrics": o.save_argmin_ckpt_by_metrics,
                   "save_argmax_ckpt_by_metrics": o.save_argmax_ckpt_by_metrics,
                   "profile_window": window}
    trainer.hooks.saved_state(trainer, trainer.step)  # a plugin's bad state fails now
    return FitPlan(train_examples, first_examples, done, examples_per_step, steps_per_epoch,
                   {"epoch": 0, "examples": 0}, evaluate, save_ckpt, fit_options, v04, started)


def start(plan: FitPlan, trainer, resumed: dict | None, sanity_check: bool) -> None:
    """Once the run has resumed (``resumed``: the checkpoint's meta, or None): where this fit
    starts in its data, then the evaluation's sanity check."""
    if resumed is not None:
        plan.position = resume_position(resumed, plan.train_examples, plan.first_examples)
    elif plan.done == 0 and trainer.step and not isinstance(plan.train_examples, Stream):
        plan.position = position_of(  # a step given (0.4's last_ckpt_info): that many updates
            {"step": trainer.step, "data": {"examples_per_step": plan.examples_per_step}},
            len(plan.first_examples))  # are made already
    if plan.evaluate is not None and sanity_check:
        plan.evaluate.sanity_check()
    trainer.hooks.on_time_spent(trainer=trainer, phase="startup", step=None,
                                seconds=time.perf_counter() - plan.started)


def n_updates(n_epochs: int | None, steps_per_epoch: int | None, max_steps: int | None) -> int:
    """The updates a fit makes: ``n_epochs`` epochs, or ``max_steps`` if that ends first."""
    by_epochs = None if n_epochs is None or steps_per_epoch is None else n_epochs * steps_per_epoch
    return min(n for n in (by_epochs, max_steps) if n is not None)


def plan_steps(trainer, train_examples, first_examples: Sequence, per_device_batch_size: int,
               n_epochs: int | None, max_steps: int | None) -> tuple[int, int | None]:
    """Decide the layout on the first examples; ``(examples per update, updates per epoch)``
    (a stream: None). Warns when the lr schedule spans another number of updates than this fit
    makes."""
    trainer.prepare(first_examples, per_device_batch_size)
    batch_size = trainer.deployer.get_global_batch_size(per_device_batch_size)
    examples_per_step = batch_size * trainer.accumulate_grad_batches
    stream = isinstance(train_examples, Stream)
    steps_per_epoch = None if stream else \
        n_full_batches(first_examples, examples_per_step, "train_examples")
    total, makes = (getattr(trainer.lr_schedule_fn, "total_steps", None),
                    n_updates(n_epochs, steps_per_epoch, max_steps))
    if total is not None and total != makes:
        warnings.warn(
            f"The lr schedule spans {total} updates but this fit makes {makes}, so it will not "
            "end at its end value. Pass accumulate_grad_batches="
            f"{trainer.accumulate_grad_batches} (and the same batch size and epochs) to "
            "deployer.get_lr_schedule_fn.", stacklevel=4)
    data = {"jax_seed": trainer.deployer.jax_seed}
    if not stream:
        data["n_examples"] = len(first_examples)  # and the shuffle above IN_MEMORY examples:
        data["shuffle"] = permutation.SHUFFLE if len(first_examples) > permutation.IN_MEMORY \
            else None  # (None: numpy's, as every checkpoint before it was written)
    source = getattr(train_examples.iterator if stream else first_examples, "fingerprint", None)
    if source is not None:  # what the examples are made of
        data["source"] = str(source)
    trainer.checkpoints.data_position = data
    return examples_per_step, steps_per_epoch


def resume_position(meta: dict, train_examples, first_examples: Sequence) -> dict:
    """Where the resumed run stands in its data (a stream: set back to it)."""
    stream = isinstance(train_examples, Stream)
    position = position_of(meta, None if stream else len(first_examples))
    if stream:
        if position.get("stream") is None:
            raise UsageError(
                f"Cannot resume from step {meta['step']}: it was written while training on a "
                "stream that cannot tell its position (an iterator without get_state() and "
                "set_state(), e.g. a generator), so where to continue is unknown. Use an "
                "iterator that has them (a Grain DatasetIterator does), or pass "
                "fit(resume=False) to start over in a new workdir.")
        train_examples.set_state(position["stream"])
    return position
