"""``Trainer``: runs the user's ``collate_fn`` and ``loss_fn`` on the deployer's mesh."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Sequence

import jax
import numpy as np
import optax

from redco import compat, epoch_loop, fit_plan, scanned_updates, watchdog
from redco import remat as redco_remat
from redco.data import by_name, check_array_leaves, check_number, n_full_batches
from redco.data_order import Stream, as_stream
from redco.deployer import Deployer
from redco.evaluation import Evaluation, mean_loss
from redco.fit_plan import FitOptions
from redco.predictor import Predictor
from redco.protocols import UsageError
from redco.run_context import LoopState, RunContext
from redco.run_hooks import RunHooks
from redco.sharding import Rules
from redco.step_checkpoints import StepCheckpoints
from redco.step_reports import timed
from redco.step_settings import StepSettings
from redco.train_step import (
    TrainState,
    check_trainable,
    compiler_options,
    input_tokens,
)
from redco.trainer_state import PlacedState

LOSS_ARGS = ("rng", "state", "params", "batch", "is_training")


def loop_overrides(hang_timeout_s: float | None, async_checkpoints: bool | None) -> dict:
    """The deployer's loop settings a ``Trainer`` overrides (those not None), checked."""
    overrides = {}
    if hang_timeout_s is not None:
        overrides["hang_timeout_s"] = watchdog.resolve(hang_timeout_s)
    if async_checkpoints is not None:
        if not isinstance(async_checkpoints, (bool, np.bool_)):
            raise TypeError(f"async_checkpoints={async_checkpoints!r}: use True or False (or "
                            "None: the deployer's).")
        overrides["async_checkpoints"] = bool(async_checkpoints)
    return overrides


def _setting(name: str) -> property:
    return property(lambda self: getattr(self.placed.settings, name),
                    doc=f"The step's ``{name}`` (``trainer.settings``, fixed when made).")


class Trainer(compat.TrainerV04):
    """Trains ``params`` with ``loss_fn(rng, state, params, batch, is_training) -> scalar``.

    Args:
      deployer: the run's ``Deployer``.
      collate_fn: ``list of examples -> dict of numpy arrays`` (first dim = batch).
      apply_fn: the model, available to ``loss_fn`` as ``state.apply_fn``.
      loss_fn: the scalar loss, or ``(loss, {name: scalar})``: those scalars are logged with
        each update (the mean of its micro-batches; ``redco.train_step.loss_and_metrics``),
        outside the gradient; the rng argument may also be named ``train_rng``.
      params: a pytree of arrays (numpy, jax, Flax NNX ``State``, ...).
      optimizer: an optax optimizer (an ``optax.MultiSteps`` wrapper is unwrapped).
      opt_state: a starting optimizer state; by default ``optimizer.init(params)``.
      compute_dtype: run ``loss_fn`` on params cast to this dtype (e.g. ``jnp.bfloat16``);
        gradients and updates stay in the params' own dtype.
      lr_schedule_fn: the schedule inside ``optimizer``, to log the learning rate.
      accumulate_grad_batches: micro-batches per optimizer update (summed inside one step).
      params_sharding_rules: ``[(regex, PartitionSpec), ...]``; by default the deployer's
        rule set, read off ``loss_fn``'s dataflow at the first batch ``fit`` sees.
      callbacks: objects with ``@redco.hookimpl`` methods, called on this trainer's hooks
        (``redco/hookspecs.py``) after its observers'.
      remat: the rematerialisation policy of the layers ``loss_fn`` runs (``"none"``,
        ``"dots_saveable"``, ``"dots_with_no_batch_dims_saveable"``, ``"full"``: see
        ``redco/remat.py``); ``None`` leaves the policy in force where the step is traced, or,
        under ``Deployer(n_model_shards="auto")``, takes the one the layout planner picked.
      trainable: a pytree of bools like ``params`` (e.g. ``redco.lora``'s mask): only the
        leaves marked True are differentiated, updated and given optimizer state; the rest is
        frozen, with no gradient memory. By default everything trains.
      count_tokens: ``micro_batch -> number`` (traced, inside the step), the tokens a batch
        counts for the logged tokens/s; by default every position of ``input_ids`` (and
        ``decoder_input_ids``). E.g. ``lambda b: (b["labels"] != -100).sum()`` counts the
        tokens the loss sees. None: no token count.
      hang_timeout_s: ``fit`` (and ``trainer.run``) end the run (exit status 124) when no train
        step has finished for this many seconds, naming the stuck process and its last step
        (``redco/watchdog.py``); ``0``: never. By default (None) the deployer's
        (``Deployer(hang_timeout_s=)``: ``$REDCO_HANG_TIMEOUT``, else 1800).
      async_checkpoints: ``fit`` writes step checkpoints in the background, from a host copy of
        the state, while training goes on (``redco/step_checkpoints.py``);
        ``False``: training waits for each write. By default (None) the deployer's (True unless
        ``Deployer(async_checkpoints=False)``).

    Redco 0.4.x's keywords are accepted too (``last_ckpt_info``, ``train_step_fn``, ...; see
    ``redco/compat.py``).

    For algorithms that drive training themselves (FedAvg, MAML): ``params``, ``step``,
    ``optimizer``, ``state`` (a ``TrainState``) and ``state_shardings`` (None until the first
    batch decides the layout), ``set_train_state``, ``train_epoch`` and ``eval_loss``.
    """

    def __init__(self, deployer: Deployer, collate_fn: Callable, apply_fn: Callable,
                 loss_fn: Callable, params: Any, optimizer: optax.GradientTransformation,
                 opt_state: Any = None, compute_dtype: Any = None,
                 lr_schedule_fn: Callable | None = None, accumulate_grad_batches: int | None = 1,
                 params_sharding_rules: Rules | None = None, callbacks: Sequence[Any] = (),
                 remat: str | None = None, trainable: Any = None,
                 count_tokens: Callable | None = input_tokens,
                 hang_timeout_s: float | None = None, async_checkpoints: bool | None = None,
                 **v04_options):
        v04 = compat.trainer_options(v04_options)
        self._overrides = loop_overrides(hang_timeout_s, async_checkpoints)
        self.deployer = deployer
        self.collate_fn = collate_fn
        self.train_step_fn = v04["train_step_fn"]
        check_array_leaves(params, "params")
        optimizer, params, accumulate_grad_batches = compat.optimizer_and_accumulation(
            optimizer, params, check_number("accumulate_grad_batches",
                                            accumulate_grad_batches or 1, 1),
            self.train_step_fn, deployer.log_info)
        settings = StepSettings(
            loss_fn=by_name(loss_fn, LOSS_ARGS), optimizer=optimizer,
            trainable=check_trainable(trainable, params, self.train_step_fn),
            accumulate_grad_batches=accumulate_grad_batches, compute_dtype=compute_dtype,
            remat=remat if remat is None else redco_remat.check(remat),
            lr_schedule_fn=lr_schedule_fn, count_tokens=count_tokens,
            make_step=compat.step_maker(self.train_step_fn))
        self.placed = PlacedState(deployer, settings, params_sharding_rules,  # the state
                                  {"params": params, "opt_state": opt_state, "apply_fn": apply_fn,
                                   "step": v04["step"]})
        self.callbacks = list(callbacks)
        self.hooks = RunHooks(self, self.callbacks)  # its observers, then the process's plugins
        self.stop_reason: str | None = None  # set by request_stop; fit stops on it
        self.context: RunContext | None = None  # the run under way (fit's, trainer.run's)
        self.fitted = False  # a fit ran to its end: a later fit trains its epochs again
        self.checkpoints = StepCheckpoints(self)  # resume and step checkpoints, as runs ask

    # the step's settings (``redco/step_settings.py``), fixed when made
    settings = property(lambda self: self.placed.settings)
    loss_fn = _setting("loss_fn")
    optimizer = _setting("optimizer")
    trainable = _setting("trainable")
    accumulate_grad_batches = _setting("accumulate_grad_batches")
    compute_dtype = _setting("compute_dtype")
    remat = _setting("remat")
    lr_schedule_fn = _setting("lr_schedule_fn")
    count_tokens = _setting("count_tokens")
    # the placed state (``redco/trainer_state.py``): None until the layout is decided
    state_shardings = property(lambda self: self.placed.shardings)
    steps = property(lambda self: self.placed.steps)
    params_sharding_rules = property(lambda self: self.placed.rules)

    @property
    def state(self) -> TrainState | None:
        return self.placed.state

    @state.setter
    def state(self, state: TrainState) -> None:  # each update's new state
        self.placed.state = state

    # ---- the layout, decided once; the state, placed once -------------------------------------
    def prepare(self, examples: Sequence, per_device_batch_size: int) -> None:
        """Decide the layout for batches of ``per_device_batch_size`` rows per device of
        ``examples`` (one device's rows are collated and traced abstractly; nothing compiles) and
        place the state on it, once: what ``fit`` does at its first batch. Call it before a loop
        of your own (``trainer.run``) (``redco/trainer_state.py``)."""
        self.placed.decide_layout(self.collate_fn, examples, per_device_batch_size)

    def set_train_state(self, params: Any = None, opt_state: Any = None,
                        step: int | None = None, **v04_options) -> None:
        """Replace the params, the optimizer state or the step (e.g. a FedAvg client starting
        from the server's params); new ``params`` without ``opt_state`` get a fresh
        ``optimizer.init``. Before the first batch they become the starting state
        (``redco/trainer_state.py``)."""
        optimizer, apply_fn = compat.train_state_options(v04_options, self.optimizer,
                                                         self.placed.apply_fn)
        if optimizer is not None or apply_fn is not None:  # (Redco 0.4's)
            self.placed.replace_optimizer_or_model(optimizer, apply_fn)
        if optimizer is not None and params is None and opt_state is None:
            params = self.params  # the new optimizer's state starts fresh
        if params is not None:
            params = compat.params_for_optimizer(self.optimizer, params)
        self.placed.set(params, opt_state, step)

    @property
    def params(self):
        """The params: placed on the mesh once the layout is decided (first batch), until then
        as given."""
        return self.placed.start["params"] if self.state is None else self.state.params

    @property
    def step(self) -> int:
        return self.placed.start["step"] if self.state is None else int(self.state.step)

    @property
    def hang_timeout_s(self) -> float | None:
        """The hang watchdog's timeout in seconds (None: no watchdog): ``Trainer(hang_timeout_s=)``,
        else the deployer's."""
        return self._overrides.get("hang_timeout_s", self.deployer.hang_timeout_s)

    @property
    def async_checkpoints(self) -> bool:
        """Whether ``fit`` writes step checkpoints in the background: ``Trainer(async_checkpoints=)``,
        else the deployer's."""
        return self._overrides.get("async_checkpoints", self.deployer.async_checkpoints)

    # ---- training ------------------------------------------------------------------------------
    def request_stop(self, reason: str) -> None:
        """Ask ``fit`` to stop after the current epoch (e.g. from ``on_eval_end``; from an
        evaluation every ``eval_every_n_steps`` updates, right after it)."""
        self.stop_reason = reason

    def train_epoch(self, examples: Sequence | Iterable, per_device_batch_size: int, epoch: int,
                    start_example: int = 0, save_every_n_steps: int | None = None,
                    keep_last_ckpts: int = 1, desc: str = "", max_updates: int | None = None,
                    evaluate_every: tuple[Evaluation, int] | None = None) -> None:
        """Run the updates of ``epoch``, from the ``start_example``-th example of its shuffled
        order on (``redco/data_order.py``; a stream: its next examples), at most
        ``max_updates`` of them; ``evaluate_every=(evaluation, n)``: evaluate after every n-th
        update (stop there if asked to). Inside ``trainer.run`` its updates are part of the
        loop's unit (the run saves and stops at the loop's ``step_done``); called on its own it
        is a run of its own, whose updates are its boundaries (``save_every_n_steps``,
        ``keep_last_ckpts``; SIGTERM saves and stops), and returns once its checkpoints are
        written (``redco/epoch_loop.py``)."""
        if self.context is not None:
            if save_every_n_steps is not None:
                raise UsageError("train_epoch(save_every_n_steps=...) inside fit() or "
                                 "trainer.run(): the run decides when to save; pass "
                                 "save_every_n_steps to trainer.run() instead.")
            epoch_loop.train_epoch(self, examples, per_device_batch_size, epoch, start_example,
                                   desc, max_updates, evaluate_every)
            return
        examples = as_stream(examples)
        self.prepare(examples.peek(per_device_batch_size) if isinstance(examples, Stream)
                     else examples, per_device_batch_size)
        with RunContext(self, save_every_n_steps=save_every_n_steps,
                        keep_last_ckpts=keep_last_ckpts, resume=None, save_at_end=False,
                        each_update=True):
            epoch_loop.train_epoch(self, examples, per_device_batch_size, epoch, start_example,
                                   desc, max_updates, evaluate_every)

    def train_scanned(self, examples: Sequence, per_device_batch_size: int,
                      epochs: Sequence[int], desc: str = "",
                      during: Callable[[], Any] | None = None) -> None:
        """Every update of ``epochs`` over ``examples`` in one compiled call: the updates
        ``train_epoch`` would run for each epoch, as a ``lax.scan`` over examples collated and
        placed once (``redco/scanned_updates.py``; ``collate_fn`` must pad to a fixed width).
        For many small updates over one RL rollout (PPO, GRPO). ``during()`` runs on this
        thread once the call is dispatched, before it is waited for (e.g. rollouts on devices
        of their own, asynchronous GRPO's). Observers see each update (``on_step_end``) once
        the call returns."""
        scanned_updates.train_scanned(self, examples, per_device_batch_size, epochs, desc,
                                      during)

    def step_flops(self) -> float | None:
        """The FLOPs of one update over the whole batch, all devices: the matrix products of
        the traced step, its micro-batch loop unrolled (with remat, recomputation included; a
        while loop inside the model counted once), fused attention counted as its unfused dots
        (``redco.step_flops``; within 2% of XLA's count where XLA gives one); None before the
        first update."""
        return None if self.steps is None else self.steps.flops(self.state)

    def lower_train_step(self, examples: Sequence, per_device_batch_size: int) -> jax.stages.Lowered:
        """The train step this Trainer runs on batches of ``per_device_batch_size`` rows per
        device (``accumulate_grad_batches`` micro-batches of them), traced and lowered for the
        first such batch of ``examples``, not compiled: ``.as_text()`` is its StableHLO. (Its
        ``.cost_analysis()`` counts the micro-batch loop once; ``step_flops()`` gives the whole
        update's FLOPs.) The layout is decided here as at the first batch."""
        self.prepare(examples, per_device_batch_size)
        batch_size = self.deployer.get_global_batch_size(per_device_batch_size)
        batch_size *= self.accumulate_grad_batches
        n_full_batches(len(examples), batch_size, "examples")
        batch = self.deployer.make_batch(list(examples[:batch_size]), self.collate_fn,
                                         n_micro=self.accumulate_grad_batches)
        return self.steps.train.lower(self.state, batch)

    def compile_train_step(self, examples: Sequence,
                           per_device_batch_size: int) -> jax.stages.Compiled:
        """``lower_train_step(...)`` compiled ahead of time and not run. Ask it what a device
        holds (``.memory_analysis()``) and computes (``.cost_analysis()``) before a long run;
        the later run compiles its own copy. It compiles as the planner measures
        (``redco.train_step.compiler_options``: on CPU, each all-reduce apart, as on a GPU)."""
        lowered = self.lower_train_step(examples, per_device_batch_size)
        return lowered.compile(compiler_options=compiler_options())

    def eval_loss(self, examples: Sequence, per_device_batch_size: int,
                  desc: str | None = None, max_batches: int | None = None) -> float:
        """Mean loss over the examples (over the first ``max_batches`` global batches of them,
        where given); the last partial batch counts by its size. A few steps at most are in
        flight at a time (``redco/in_flight.py``)."""
        n_full_batches(len(examples), 1, "eval_examples")
        self.prepare(examples, min(per_device_batch_size, len(examples)))
        return mean_loss(self, examples, per_device_batch_size, max_batches)

    def ckpt_tree(self) -> dict:
        """What a step checkpoint holds of the state (params, optimizer state, rng), as placed
        on the devices: ``deployer.load_ckpt(path, trainer.ckpt_tree())`` restores onto it."""
        return {"params": self.state.params, "opt_state": self.state.opt_state,
                "rng": self.state.rng}

    def save_step_ckpt(self, epoch: int | None = None, keep_last_ckpts: int = 1,
                       background: bool = False) -> str:
        """Checkpoint everything a resume needs as ``ckpts/step_<step>``; keep the newest
        ``keep_last_ckpts`` of them. With ``background`` (a run's own saves), training goes on
        while it is written (``Trainer(async_checkpoints=)``, ``redco/step_checkpoints.py``):
        it is complete when ``on_checkpoint_saved`` is called for it. (A run decides when to
        save by itself: ``trainer.run``'s ``save_every_n_steps``.)"""
        with self.hang_watch_paused(f"saving step checkpoint step_{self.step}"), \
                timed(self, "checkpoint"):
            path = self.checkpoints.save(epoch, keep_last_ckpts, background)
        self.checkpoints.announce()
        return path

    def hang_watch_paused(self, waiting_for: str | None = None):
        """``with trainer.hang_watch_paused():`` around long work that is not a step (a
        checkpoint, an evaluation; your own in a callback) keeps ``Trainer(hang_timeout_s=)``
        from taking it for a hang; ``waiting_for`` (what it waits for): unless it lasts longer
        than that timeout."""
        return self.context.paused(waiting_for) if self.context is not None \
            else contextlib.nullcontext()

    def fit(self, train_examples: Sequence | Callable | Iterable, per_device_batch_size: int,
            n_epochs: int | None = None, eval_examples: Sequence | None = None,
            eval_per_device_batch_size: int | None = None, eval_loss: bool = True,
            eval_predictor: Predictor | None = None, eval_metric_fn: Callable | None = None,
            save_last_ckpt: bool = False, save_argmin_ckpt_by_metrics: Sequence[str] | None = None,
            save_argmax_ckpt_by_metrics: Sequence[str] | None = None,
            save_every_n_steps: int | None = None, keep_last_ckpts: int = 1,
            resume: bool = True, eval_sanity_check: bool = True,
            profile_steps: tuple[int, int] | None = None, max_steps: int | None = None,
            eval_every_n_steps: int | None = None, max_eval_batches: int | None = None,
            **v04_options) -> None:
        """Train for ``n_epochs`` (or ``max_steps`` updates, whichever ends first), evaluating
        after each epoch (and every ``eval_every_n_steps`` updates; on the first
        ``max_eval_batches`` global batches of ``eval_examples``, where given) and
        checkpointing as asked.

        ``train_examples`` is any random-access sequence (a corpus on disk read row by row; each
        process reads only its rows), a function of the epoch index (``epoch_idx``) returning
        that epoch's examples, or a stream: an iterator, trained on for ``max_steps`` updates
        (``redco/data_order.py``). Examples with a ``fingerprint`` string naming their content
        have it saved with each step checkpoint, a resume against other content refused. With
        ``resume`` (the default), a step checkpoint in ``workdir/ckpts`` is restored first and
        training continues from its exact step and example, mid-epoch included, also with
        another batch size or number of processes. Best-by-metric checkpoints go to
        ``ckpts/best_<metric>``; ``loss`` is always a metric when evaluated. With
        ``eval_sanity_check`` (the default) the evaluation runs once on one batch before
        training, so a broken ``pred_fn`` or metric fails in seconds; a misspelled metric name
        is refused before anything compiles (its names read off ``eval_metric_fn`` called once
        on zeros shaped like ``pred_fn``'s output). ``profile_steps=(start, stop)`` writes a
        profiler trace of those updates (``redco/observers/profiler.py``). Redco 0.4.x's
        keywords are accepted too (``save_ckpt_every_k_epochs``, ...; see ``redco/compat.py``).
        """
        options = FitOptions(**{name: value for name, value in locals().items() if name != "self"})
        self.stop_reason = None  # a stop asked in an earlier fit does not end this one
        plan = fit_plan.plan_fit(self, options)
        with RunContext(self, save_every_n_steps=options.save_every_n_steps,
                        keep_last_ckpts=keep_last_ckpts, resume=None if self.fitted else resume,
                        save_at_end=False, each_update=True, saves=plan.save_ckpt) as run, \
                self.hooks.registered(plan.v04):  # (Redco 0.4's per-epoch saves)
            fit_plan.start(plan, self, run.resumed, eval_sanity_check)
            self.hooks.on_fit_start(trainer=self, n_epochs=n_epochs, fit_options=plan.fit_options,
                                    steps_per_epoch=plan.steps_per_epoch)
            epoch_loop.train_epochs(self, plan, options, run)
            self.checkpoints.announce(wait=True)
            self.fitted = True
            self.hooks.on_fit_end(trainer=self)

    def run(self, loop: LoopState | None = None, save_every_n_steps: int | None = None,
            save_every_minutes: float | None = None, keep_last_ckpts: int = 1,
            resume: bool = True, save_at_end: bool = True) -> RunContext:
        """``with trainer.run(loop=...) as run:``, then ``run.step_done()`` after each unit of
        your loop: ``fit``'s resume, step checkpoints, SIGTERM save-and-stop and hang watchdog for
        any loop, acting only at those boundaries (``redco/run_context.py``). Call
        ``trainer.prepare`` first."""
        return RunContext(self, loop, save_every_n_steps, save_every_minutes, keep_last_ckpts,
                          resume, save_at_end)

    def get_default_predictor(self, pred_fn: Callable, output_fn: Callable | None = None
                              ) -> Predictor:
        """A ``Predictor`` sharing this trainer's deployer, collate_fn and sharding rules (the
        final ones, decided at the first batch, even when it is made before ``fit``)."""
        return Predictor(deployer=self.deployer, collate_fn=self.collate_fn, pred_fn=pred_fn,
                         output_fn=output_fn, params_sharding_rules=self.params_sharding_rules)

