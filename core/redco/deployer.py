"""``Deployer``: everything about devices, hosts, randomness, logging and files, in one place
(the log itself: ``redco/run_log.py``)."""
from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from redco import _private, checkpointing, compile_cache, plugins, sequence_split, watchdog
from redco.compat import DeployerV04, ask_planner
from redco.data import check_collated, check_number
from redco.lr_schedule import LrSchedule
from redco.permutation import FeistelOrder, epoch_order
from redco.protocols import Layout, LayoutRequest
from redco.run_log import RunLog
from redco.sharding import Rules, RuleSetRules, is_rule_set, make_mesh, shardings_from_specs, specs_from_rules


def mesh_devices(devices: Sequence) -> list:
    """``Deployer(devices=)``'s pick, checked: as many of every process's devices."""
    per_process = [sum(d.process_index == p for d in devices) for p in range(jax.process_count())]
    if not devices or len(set(per_process)) > 1:
        raise ValueError(f"Deployer(devices=) picked {per_process} devices of the processes: "
                         "the mesh needs as many of each process's devices, at least one.")
    return list(devices)


class Deployer(DeployerV04):
    """Sets up the run: joins the processes, builds the ``('dp', 'mp')`` mesh (``('dp', 'cp',
    'mp')`` with context parallelism), owns the seed, the workdir, the loggers and the
    checkpoint format.

    Args:
      jax_seed: seed of every random number in the run (shuffling, dropout, sampling).
      n_model_shards: tensor-parallel degree ``mp``; the other devices form ``dp``. ``"auto"``
        lets ``Trainer.fit`` pick the smallest layout whose compiled train step fits
        ``device_memory``, on its first batch (the ``redco-planner`` plugin).
      device_memory: bytes per device (``"40GB"``) for ``n_model_shards="auto"``; read from the
        device on GPUs and TPUs.
      n_context_shards: context-parallel degree ``cp``: each sequence split over this many
        devices (the mesh becomes ``('dp', 'cp', 'mp')``), for a model whose attention can run
        over a split sequence (``redco/sequence_split.py``); ``context_strategy`` how its
        attention meets the other devices' keys: ``"all_gather"`` or ``"ring"``. ``"auto"``:
        the layout planner picks it at the first batch, as it picks ``n_model_shards="auto"``;
        by default (None) 1, or ``"auto"`` with ``n_model_shards="auto"``.
      workdir: where logs, metrics and checkpoints go; ``None`` writes nothing.
      run_tensorboard: also write TensorBoard event files under ``workdir/tensorboard``.
      n_processes, host0_address, host0_port, process_id: a multi-host run over bare IPs.
      n_local_devices: use only this many devices of this process (a cap per process; the
        mesh is every process's devices together, the count ``redco plan --devices`` plans for).
        With several processes the launcher hides the others from JAX.
      devices: the mesh's devices, picked once the processes joined: a function of every
        device of the run (``jax.devices()``) returning some of them, the same count from each
        process. The others stay visible to JAX for programs of the caller's own (asynchronous
        GRPO's rollout mesh takes the last devices of each process).
      sharding_rules: name of the rule-set plugin behind ``get_sharding_rules`` (``auto``,
        ``auto-names``: ``auto`` from parameter names only, for a model the dataflow walker
        cannot follow; ``fsdp``, ``auto+fsdp``, ``replicate``, or a third party's), or your own
        rules ``[(regex, PartitionSpec), ...]``: then exactly those, anything unmatched
        replicated.
      checkpoint_format: the checkpoint-format plugin that writes checkpoints: ``orbax``,
        ``safetensors``, ``msgpack`` or a third party's. Loading reads any format.
      async_checkpoints: ``Trainer.fit`` writes step checkpoints in the background, from a host
        copy of the state, while training goes on (``redco/step_checkpoints.py``).
        ``False``: training waits for each write. The default for every Trainer on this
        deployer; ``Trainer(async_checkpoints=)`` overrides it.
      loggers: names of the metric-logger plugins to run (process 0 only): by default
        ``$REDCO_LOGGERS`` (comma-separated), else ``jsonl`` (``redco zoo run`` sets every
        installed logger that needs no setup).
      launcher: name of a launcher plugin; by default the first that detects itself.
      verbose: print log lines and show progress bars (process 0 only); ``False`` keeps the
        terminal quiet, and ``workdir/log.txt`` is written all the same.
      compile_cache_dir: where compiled steps are kept across restarts (a resumed or requeued
        run loads them instead of compiling): by default ``$REDCO_COMPILE_CACHE``, else
        ``<workdir>/compile_cache``; ``False`` (or ``REDCO_COMPILE_CACHE=off``) for none. It
        is the Deployer's, not a Trainer's: JAX keeps one compile cache per process.
      hang_timeout_s: ``Trainer.fit`` ends the run (exit status 124) when no train step has
        finished for this many seconds, naming the stuck process and its last step
        (``redco/watchdog.py``): by default ``$REDCO_HANG_TIMEOUT``, else 1800; ``0`` (or
        ``REDCO_HANG_TIMEOUT=off``): never. The default for every Trainer on this deployer;
        ``Trainer(hang_timeout_s=)`` overrides it.
      wandb_init_kwargs: Redco 0.4.x's Weights & Biases switch: ``wandb.init(**kwargs)`` on
        process 0 and the ``wandb`` logger (plugin ``redco-wandb``).

    Redco 0.4.x's method names are here too (``redco/compat.py``).
    """

    def __init__(self, jax_seed: int, n_model_shards: int | str = 1,
                 workdir: str | None = "./workdir",
                 run_tensorboard: bool = False, n_processes: int | None = None,
                 host0_address: str | None = None, host0_port: int | None = None,
                 process_id: int | None = None, n_local_devices: int | None = None,
                 sharding_rules: str | Rules = "auto", checkpoint_format: str = "orbax",
                 loggers: Sequence[str] | None = None, launcher: str | None = None,
                 device_memory: int | str | None = None, verbose: bool = True,
                 wandb_init_kwargs: dict | None = None,
                 compile_cache_dir: str | bool | None = None,
                 hang_timeout_s: float | None = None, async_checkpoints: bool = True,
                 n_context_shards: int | str | None = None, context_strategy: str = "all_gather",
                 devices: Callable[[list], Sequence] | None = None):
        check_number("jax_seed", jax_seed, 0)
        if context_strategy not in sequence_split.STRATEGIES:
            raise ValueError(f"context_strategy={context_strategy!r}: choose one of "
                             f"{sequence_split.STRATEGIES}.")
        if n_context_shards is None:
            n_context_shards = "auto" if n_model_shards == "auto" else 1
        self.n_context_shards, self.context_strategy = n_context_shards, context_strategy
        planned = "auto" in (n_model_shards, n_context_shards)  # by the layout planner
        self.async_checkpoints = async_checkpoints
        self.hang_timeout_s = watchdog.resolve(hang_timeout_s)
        config = dict(n_processes=n_processes, host0_address=host0_address,
                      host0_port=host0_port, process_id=process_id,
                      n_local_devices=n_local_devices)
        self._launch(launcher, config)
        self.devices = jax.devices()
        if n_local_devices and jax.process_count() == 1:
            self.devices = self.devices[:n_local_devices]
        if devices is not None:
            self.devices = mesh_devices(devices(self.devices))
        self.mesh, self.n_model_shards = None, n_model_shards
        self.layout: Layout | None = None  # the layout planner's pick (n_model_shards="auto")
        if isinstance(sharding_rules, str):
            plugins.lookup("sharding_rules", sharding_rules)  # an unknown name fails here
        elif planned:
            raise ValueError("The layout planner (n_model_shards or n_context_shards 'auto') "
                             "chooses among rule sets by name; with your own rules list, set "
                             "n_model_shards and n_context_shards yourself.")
        self.device_memory = device_memory
        if not planned:
            self.mesh = make_mesh(self.devices, n_model_shards, n_context_shards)
        self.params_sharding_rules: Rules | None = None  # the final rules, once decided
        self.jax_seed = jax_seed
        self.workdir = os.path.abspath(workdir) if workdir is not None else None
        self.compile_cache_dir = compile_cache.resolve(compile_cache_dir, self.workdir)
        compile_cache.use(self.compile_cache_dir)
        self._rng = jax.random.PRNGKey(jax_seed)
        self._rules_name = sharding_rules
        plugins.lookup("checkpoint_formats", checkpoint_format)  # unknown names fail here
        self.checkpoint_format = checkpoint_format
        self.wandb_init_kwargs = wandb_init_kwargs
        if loggers is None:
            loggers = [n for n in os.environ.get("REDCO_LOGGERS", "jsonl").split(",") if n]
        self._setup_logging(verbose, list(loggers) + (["tensorboard"] if run_tensorboard else []) +
                            (["wandb"] if wandb_init_kwargs is not None else []))

    # ---- processes and devices -------------------------------------------------------------
    @staticmethod
    def _launch(name: str | None, config: dict) -> None:
        launcher = plugins.lookup("launchers", name) if name is not None else next(
            ln for ln in plugins.registry("launchers").values() if ln.detect(config))
        launcher.initialize(config)

    def lost_process_error(self, error: Exception) -> RuntimeError:
        """The error to stop with when a collective failed in a multi-process run, naming the
        processes that stopped answering (asked of jax's coordination service)."""
        n = jax.process_count()
        try:
            live = _private.live_processes(_private.coordination_client(), n)
        except jax.errors.JaxRuntimeError:  # the service itself may be gone with process 0
            live = list(range(n))
        lost = sorted(set(range(n)) - set(live))
        who = f"process {', '.join(map(str, lost))}" if lost else \
            "another process (or the coordinator, process 0)"
        return RuntimeError(
            f"Lost {who} of {jax.process_count()}: a collective failed ({error}). Process "
            f"{jax.process_index()} stops too. Fix or restart the lost host and run the same "
            "command again: training resumes from the last step checkpoint.")

    @property
    def is_main_process(self) -> bool:
        return jax.process_index() == 0

    @property
    def dp_size(self) -> int:
        if self.mesh is None:
            raise RuntimeError("n_model_shards='auto': the mesh, and so the data-parallel size, is "
                               "picked at Trainer.fit's first batch; set n_model_shards to know "
                               "it earlier.")
        return self.mesh.shape["dp"]

    def get_global_batch_size(self, per_device_batch_size: int) -> int:
        check_number("per_device_batch_size", per_device_batch_size, 1)
        return per_device_batch_size * self.dp_size

    def _local_rows(self, global_size: int) -> slice:
        """The rows of a dp-sharded global batch that this process's devices hold."""
        by_dp = self.mesh.devices.reshape(self.dp_size, -1)  # (a cp axis too: still dp first)
        mine = [i for i, row in enumerate(by_dp)
                if any(d.process_index == jax.process_index() for d in row)]
        per_row = global_size // self.dp_size
        return slice(mine[0] * per_row, (mine[-1] + 1) * per_row)

    def make_batch(self, examples: Sequence, collate_fn: Callable, n_micro: int | None = None):
        """Collate this process's share of a global batch into dp-sharded global arrays (only
        that share of ``examples`` is read: it may be a lazy ``data_order.Rows``).

        With ``n_micro`` the leaves get a leading micro-batch axis ``(n_micro, B, ...)``. A batch
        whose size does not divide ``dp`` is collated whole by every process and replicated.
        """
        m = len(examples) // (n_micro or 1)
        groups = [examples[i * m:(i + 1) * m] for i in range(n_micro or 1)]
        size = len(groups[0])
        sharded = size % self.dp_size == 0
        rows = self._local_rows(size) if sharded else slice(0, size)
        local = [check_collated(collate_fn(list(g[rows])), rows.stop - rows.start)
                 for g in groups]
        if n_micro is None:
            local, lead = local[0], ()
        else:
            local, lead = jax.tree.map(lambda *xs: np.stack(xs), *local), (None,)
        sharding = NamedSharding(self.mesh, P(*lead, "dp") if sharded else P())

        def to_global(x):
            shape = x.shape[:len(lead)] + (size,) + x.shape[len(lead) + 1:]
            return jax.make_array_from_process_local_data(sharding, x, shape)
        return jax.tree.map(to_global, local)

    # ---- randomness --------------------------------------------------------------------------
    def gen_rng(self) -> jax.Array:
        """A fresh key, split from the deployer's seed (the sequence is the same every run)."""
        self._rng, rng = jax.random.split(self._rng)
        return rng

    def epoch_permutation(self, n_examples: int, epoch: int) -> np.ndarray | FeistelOrder:
        """The shuffled example order of ``epoch``: a function of the seed and the epoch only,
        so a resumed run sees exactly the order the interrupted one would have; above 2^20
        examples computed a slice at a time (``redco/permutation.py``)."""
        return epoch_order(n_examples, self.jax_seed, epoch)

    # ---- learning rate -----------------------------------------------------------------------
    def get_lr_schedule_fn(self, train_size: int, per_device_batch_size: int, n_epochs: int,
                           learning_rate: float, schedule_type: str = "linear",
                           warmup_rate: float = 0.0, warmup_steps: int | None = None,
                           init_learning_rate: float = 0.0, end_learning_rate: float = 0.0,
                           accumulate_grad_batches: int = 1,
                           warmup_ratio: float | None = None,
                           max_steps: int | None = None) -> optax.Schedule:
        """Warmup then linear or cosine decay, counted in optimizer updates: the value is
        ``end_learning_rate`` exactly at the last update of ``n_epochs`` (of ``max_steps``
        updates, where given, as ``fit(max_steps=...)`` trains; then the data's size does not
        count); under ``n_model_shards="auto"`` counted once the layout is picked
        (``redco/lr_schedule.py``). (``warmup_ratio``: Redco 0.4.x's name of ``warmup_rate``.)"""
        warmup_rate = warmup_ratio if warmup_ratio is not None else warmup_rate
        if max_steps is not None:
            check_number("max_steps", max_steps, 1)
            return LrSchedule(lambda: max_steps, max_steps, 1, learning_rate, schedule_type,
                              warmup_rate, warmup_steps, init_learning_rate, end_learning_rate)
        for name, value in (("train_size", train_size), ("per_device_batch_size",
                            per_device_batch_size), ("accumulate_grad_batches", accumulate_grad_batches)):
            check_number(name, value, 1)

        def updates_per_epoch() -> int | None:  # None until the planner picks the layout
            if self.mesh is None:
                return None
            batch = self.get_global_batch_size(per_device_batch_size) * accumulate_grad_batches
            if train_size < batch:
                raise ValueError(f"train_size={train_size} gives no full batch of {batch} "
                                 "examples.")
            return train_size // batch
        one_device = max(train_size // (per_device_batch_size * accumulate_grad_batches), 1)
        schedule = LrSchedule(updates_per_epoch, one_device, n_epochs, learning_rate,
                              schedule_type, warmup_rate, warmup_steps, init_learning_rate,
                              end_learning_rate)
        updates_per_epoch()  # too few examples for a batch: refused now, where the layout is set
        return schedule

    # ---- sharding: rules, and the one step that decides the layout ----------------------------
    def get_sharding_rules(self, params: Any = None, rules: Rules | None = None,
                           trace_fn: Callable | None = None,
                           params_shape_or_params: Any = None) -> Rules:
        """The rules for ``params``: ``rules`` (user overrides, checked first), then the rule-set
        plugin's. Plain data: print, edit and pass back as ``params_sharding_rules``.

        ``trace_fn(params)`` runs the model on an example input (any shapes; it is only traced,
        never run), e.g. ``lambda p: apply_fn(p, jnp.zeros((1, 8), jnp.int32))``: the ``auto``
        rules then follow the model's dataflow. Without it (the paper's call) the rules come from
        parameter names for now, as ``RuleSetRules`` that remember so: a ``Trainer`` given them
        unchanged reads the final rules off ``loss_fn``'s dataflow at its first batch.
        (``params_shape_or_params``: Redco 0.4.x's name of ``params``.)
        """
        params = params if params is not None else params_shape_or_params
        if not isinstance(self._rules_name, str):  # the user's own rules, nothing else
            return list(rules or []) + list(self._rules_name)
        if trace_fn is not None and self.mesh is not None:
            return list(rules or []) + self._rule_set(params, trace_fn)
        return RuleSetRules(self._rule_set(params) if self.mesh is not None else [], rules)

    def _rule_set(self, params: Any, trace_fn: Callable | None = None) -> Rules:
        make_rules = plugins.lookup("sharding_rules", self._rules_name)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
        return make_rules(abstract, self.mesh, trace_fn)

    def decide_layout(self, params: Any, rules: Rules | None, trace_fn: Callable | None = None,
                      request: LayoutRequest | None = None) -> Layout:
        """The layout of ``params``, decided once, at the first batch ``fit`` (or ``predict``)
        sees, and adopted (``adopt``). ``n_model_shards="auto"``: the ``auto`` layout planner
        (plugin ``redco-planner``) is asked with ``request`` (the loss, one device's batch and
        the trainer's step settings) and compiles each candidate layout (and, with no remat
        policy set, each policy). A plain list of ``rules`` is used as given; ``None`` or
        ``RuleSetRules`` give the rule set's rules read off ``trace_fn``'s dataflow (a
        ``redco.dataflow.DataflowError`` if the walker cannot follow it), after the overrides
        they carry."""
        planned = None
        if self.mesh is None:
            if request is None:
                raise ValueError("n_model_shards='auto' picks the layout by compiling the train "
                                 "step at Trainer.fit's first batch; to predict without training "
                                 "first, set n_model_shards.")
            planned = self.plan_layout(request)
            self.adopt(planned)
        if not is_rule_set(rules):
            return self._fixed(rules if isinstance(rules, dict) else list(rules))
        final = list(getattr(rules, "overrides", [])) + (
            list(planned.rules) if planned is not None else self._rule_set(params, trace_fn))
        self.params_sharding_rules = final
        return self._fixed(final) if self.layout is None else self.layout._replace(rules=final)

    def _fixed(self, rules: Rules) -> Layout:
        """The layout this deployer was given (no planner chose, so no remat policy): its
        degrees and ``rules``."""
        return Layout(self.n_model_shards, self._rules_name if isinstance(self._rules_name, str)
                      else "custom", rules, remat=None, n_context_shards=self.mesh.shape.get("cp", 1))

    def plan_layout(self, request: LayoutRequest) -> Layout:
        """Ask the ``auto`` layout planner, over this deployer's rule sets and degrees (those
        not "auto"), for the layout to use; logged."""
        rule_sets = (self._rules_name,) if self._rules_name != "auto" else ("auto", "auto+fsdp")
        degrees = {name: None if value == "auto" else (value,) for name, value in
                   (("model_degrees", self.n_model_shards),
                    ("context_degrees", self.n_context_shards))}
        planner = plugins.lookup("layout_planners", "auto")
        picked = ask_planner(planner, self, request.replace(rule_sets=rule_sets, **degrees))
        self.log_info(f"layout planner: picked n_model_shards={picked.n_model_shards}, "
                      f"n_context_shards={picked.n_context_shards}, "
                      f"sharding_rules={picked.sharding_rules!r}, remat={picked.remat!r}")
        return picked

    def adopt(self, layout: Layout) -> None:
        """Run on ``layout`` from now on: its mesh, degrees and rule set."""
        self.layout = layout
        self._rules_name, self.n_model_shards = layout.sharding_rules, layout.n_model_shards
        self.n_context_shards = layout.n_context_shards
        self.mesh = make_mesh(self.devices, layout.n_model_shards, layout.n_context_shards)

    @property
    def layout_plan(self) -> Any:
        """The layout planner's report of the layout it picked (None where none picked)."""
        return None if self.layout is None else self.layout.report

    def get_params_shardings(self, params: Any, rules: Rules):
        return shardings_from_specs(specs_from_rules(params, rules, self.mesh), self.mesh)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    # ---- checkpoints ---------------------------------------------------------------------------
    @property
    def ckpt_dir(self) -> str | None:
        return os.path.join(self.workdir, "ckpts") if self.workdir is not None else None

    def save_ckpt(self, name: str | None = None, tree: Any = None, meta: dict | None = None,
                  **v04) -> str:
        """Write ``tree`` and ``meta`` as the checkpoint ``workdir/ckpts/<name>``. (Redco 0.4.x's
        ``save_ckpt(ckpt_dir, params=, opt_state=, float_dtype=, **info)`` works too.)"""
        if tree is None:
            return self._save_ckpt_v04(**({"ckpt_dir": name} if name else {}), **v04)
        if self.workdir is None:
            raise ValueError(f"Cannot save checkpoint {name!r}: this Deployer has workdir=None, "
                             "which writes nothing. Give it a workdir.")
        return checkpointing.save(self.ckpt_dir, name, tree, meta or {}, self.checkpoint_format)

    def load_ckpt(self, path: str | None = None, target: Any = None, **v04) -> tuple[Any, dict]:
        """Read the checkpoint at ``path`` (any format) onto ``target``'s shapes and shardings;
        ``target`` may be a subset of what was saved, e.g. ``{"params": trainer.params}``.
        Returns ``(tree, meta)``. (Redco 0.4.x's ``load_ckpt(ckpt_dir, params_sharding_rules=,
        optimizer=, float_dtype=, load_params=, load_opt_state=, update_rng=)`` works too.)"""
        if target is None:
            return self._load_ckpt_v04(**({"ckpt_dir": path} if path else {}), **v04)
        return checkpointing.load(path, target)

    # ---- logging (redco/run_log.py) -----------------------------------------------------------
    def _setup_logging(self, verbose: bool, logger_names: list[str]) -> None:
        self.run_log = RunLog(self.workdir, verbose, logger_names,
                              {"wandb": self.wandb_init_kwargs or {}})
        self.log_info(f"devices: {jax.device_count()} ({jax.devices()[0].platform}), processes: "
                      f"{jax.process_count()}, mesh: "
                      f"{dict(self.mesh.shape) if self.mesh else 'picked by Trainer.fit'}")

    @property
    def show_progress(self) -> bool:
        """Whether this process draws progress bars: process 0, when verbose."""
        return self.run_log.show_progress

    def log_info(self, info: Any, title: str | None = None, step: int | None = None) -> None:
        """Write ``info`` to ``workdir/log.txt`` and, if verbose, print (process 0 only); with a
        ``title`` (and ``step``) as a framed block, as Redco 0.4.x did."""
        self.run_log.info(info, title, step)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Hand ``metrics`` at ``step`` to every metric logger (process 0); ``log_metrics(step,
        metrics)`` works too."""
        if not isinstance(metrics, dict):
            step, metrics = metrics, step
        self.run_log.metrics(metrics, step)

    def save_json(self, name: str, data: Any) -> str | None:
        """Write ``data`` as ``workdir/<name>`` and return its path (process 0; nothing with
        ``workdir=None``)."""
        return self.run_log.save_json(name, data)

    def forget_metrics_after(self, step: int) -> None:
        """Tell the metric loggers that the run resumed at ``step`` (those that can drop what
        they logged after it do)."""
        self.run_log.forget_after(step)

    def close(self) -> None:
        self.run_log.close()
