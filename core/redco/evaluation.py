"""``fit``'s evaluation after each epoch, planned and checked before anything compiles.

``Evaluation.plan(trainer, examples, ...)`` checks the inputs first: enough examples for a batch,
and every metric ``save_arg*_ckpt_by_metrics`` names among those the evaluation gives. Those are
read off ``eval_metric_fn`` called once on zeros shaped like ``pred_fn``'s output (``pred_fn``
traced, not compiled); where ``output_fn`` or the metric cannot take zeros, the sanity check's
real evaluation checks the names instead. ``evaluation.sanity_check()`` runs it once on one
batch before training, so a broken ``pred_fn`` or metric fails in seconds;
``evaluation(epoch)`` runs it on every example (the first ``max_batches`` global batches of them,
where ``fit(max_eval_batches=)`` bounds it: the cut is said in the log), logs it, writes
``eval_results_epoch<i>.json`` (``eval_results_step<n>.json`` for one every
``eval_every_n_steps`` updates) and calls ``on_eval_end`` (where the best checkpoints are kept).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from redco import compat
from redco.data import n_full_batches
from redco.in_flight import read_in_order


def first_batches(examples: Sequence, batch_size: int, max_batches: int | None) -> Sequence:
    """The first ``max_batches`` batches of ``batch_size`` of ``examples`` (None: all)."""
    return examples if max_batches is None else examples[:max_batches * batch_size]


def mean_loss(trainer: Any, examples: Sequence, per_device_batch_size: int,
              max_batches: int | None) -> float:
    """``Trainer.eval_loss``: the mean loss, the last partial batch counted by its size, a few
    batches in flight at a time (``redco/in_flight.py``)."""
    batch_size = trainer.deployer.get_global_batch_size(per_device_batch_size)
    examples = first_batches(examples, batch_size, max_batches)

    def dispatched():
        for begin in range(0, len(examples), batch_size):
            chunk = list(examples[begin:begin + batch_size])
            batch = trainer.deployer.make_batch(chunk, trainer.collate_fn)
            yield trainer.steps.eval_step(trainer.state, batch), len(chunk)
    summed = sum(read_in_order(dispatched(), lambda loss_n: float(loss_n[0]) * loss_n[1]))
    return summed / len(examples)


def refuse_missing_metrics(metric_names: Sequence[str], names: set[str], found: str) -> None:
    """Raise if ``save_arg*_ckpt_by_metrics`` names a metric the evaluation does not give."""
    missing = [name for name in metric_names if name not in names]
    if missing:
        raise KeyError(f"save_arg*_ckpt_by_metrics names {missing} but the eval metrics are "
                       f"{sorted(names)} (found {found}). Name one of those.")


@dataclass
class Evaluation:
    trainer: Any
    examples: Sequence
    per_device_batch_size: int
    eval_loss: bool
    predictor: Any
    metric_fn: Callable | None
    metric_names: list[str]  # those save_arg*_ckpt_by_metrics names
    max_batches: int | None = None  # fit(max_eval_batches=)
    cut_said: bool = field(default=False, init=False)
    last_step: int | None = field(default=None, init=False)  # the update last evaluated after

    @classmethod
    def plan(cls, trainer, examples, per_device_batch_size: int, eval_loss: bool, predictor,
             metric_fn, metric_names: list[str], check_names: bool,
             max_batches: int | None = None) -> Evaluation | None:
        """The evaluation, its inputs checked (and with ``check_names`` the metric names);
        None without ``examples``."""
        if examples is None:
            return None
        evaluation = cls(trainer, examples, per_device_batch_size, eval_loss, predictor,
                         metric_fn, metric_names, max_batches)
        n_full_batches(len(examples), 1, "eval_examples")
        if check_names:
            evaluation.check_names()
        return evaluation

    def check_names(self) -> None:
        """Refuse a metric name the evaluation cannot give, from ``pred_fn`` traced."""
        names = {"loss"} if self.eval_loss else set()
        if all(name in names for name in self.metric_names):
            return
        if self.predictor is not None and self.metric_fn is not None:
            preds, batch_size = self.predictor.traced_preds(
                self.examples, self.per_device_batch_size, self.trainer.params)
            first = list(self.examples[:batch_size])
            try:
                outputs = self.predictor.per_example(preds, batch_size)[:len(first)]
                names |= set(compat.call_metric_fn(self.metric_fn, first, outputs))
            except Exception:  # zeros are not predictions this metric_fn can score
                return
        refuse_missing_metrics(self.metric_names, names, "before compiling, from pred_fn traced")

    def evaluated_examples(self) -> Sequence:
        """The examples each evaluation runs on: with ``max_batches``, the first that many
        global batches (the layout's, decided by now); a cut is said in the log, once."""
        size = self.trainer.deployer.get_global_batch_size(self.per_device_batch_size)
        kept = first_batches(self.examples, size, self.max_batches)
        if len(kept) < len(self.examples) and not self.cut_said:
            self.trainer.deployer.log_info(
                f"Evaluating on the first {len(kept):,} of {len(self.examples):,} eval examples: "
                f"{self.max_batches} batches of {size} (max_eval_batches; None evaluates all).")
            self.cut_said = True
        return kept

    def sanity_check(self) -> None:
        """The evaluation once, on one batch, before training."""
        trainer = self.trainer
        size = trainer.deployer.get_global_batch_size(self.per_device_batch_size)
        metrics = self.run(list(self.examples[:size]), trainer.params, "sanity check")
        refuse_missing_metrics(self.metric_names, set(metrics),
                               "before training by fit's eval_sanity_check")
        trainer.deployer.log_info("Sanity check passed: the evaluation ran on one batch.")

    def run(self, examples: Sequence, params: Any, desc: str) -> dict[str, float]:
        """The loss and ``metric_fn``'s metrics on ``examples``."""
        metrics = {}
        if self.eval_loss:
            metrics["loss"] = self.trainer.eval_loss(examples, self.per_device_batch_size)
        if self.predictor is not None:
            preds = self.predictor.predict(examples, self.per_device_batch_size, params=params,
                                           desc=desc)
            if self.metric_fn is not None:
                metrics.update({k: float(v) for k, v in
                                compat.call_metric_fn(self.metric_fn, examples, preds).items()})
        return metrics

    def __call__(self, epoch: int, mid_epoch: bool = False) -> dict[str, float]:
        """The evaluation after ``epoch`` (``mid_epoch``: after the current update, in
        ``epoch``): logged, written, handed to ``on_eval_end``."""
        trainer = self.trainer
        when = f"step {trainer.step}" if mid_epoch else f"epoch {epoch + 1}"
        metrics = self.run(self.evaluated_examples(), trainer.state.params, f"predict {when}")
        trainer.deployer.log_info(f"{when} eval: " +
                                  ", ".join(f"{k} = {v:.5g}" for k, v in metrics.items()))
        trainer.deployer.log_metrics({f"eval/{k}": v for k, v in metrics.items()}, trainer.step)
        trainer.deployer.save_json(f"eval_results_{when.replace(' ', '')}.json"
                                   if mid_epoch else f"eval_results_epoch{epoch}.json", metrics)
        self.last_step = trainer.step
        trainer.hooks.on_eval_end(trainer=trainer, epoch=epoch, metrics=metrics)
        return metrics
