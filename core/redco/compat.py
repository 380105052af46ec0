"""Redco 0.4.x's names, so that scripts written for the published package find every name they call.

The paper's script and the original repository's examples call ``Deployer``, ``Trainer`` and
``Predictor`` by Redco 0.4.23's names (some by the 0.4.16-era ones). The mixins below map each
onto this package's own API; redco itself never calls them, so none changes what a script
written for this package does. README "Coming from Redco 0.4" lists every name.

What differs underneath: checkpoints are this package's atomic directories (``meta.json`` +
``state/``), not 0.4's ``params/`` + ``info.json``; ``fit`` always writes its step checkpoints
in full precision (a resume is bitwise), so ``save_float_dtype`` and ``save_opt_states`` apply
to the checkpoints a script saves by name.
"""
from __future__ import annotations

import functools
import inspect
import os
from typing import Any, Callable

import flax.core
import flax.training.train_state
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from redco import checkpointing
from redco.data import by_name, cast_floats
from redco.plugins import hookimpl
from redco.sharding import opt_state_shardings, shardings_from_specs, specs_from_rules
from redco.train_step import loss_and_metrics, unwrap_multisteps

META_KEYS = ("format", "arrays", "files", "path")  # what meta.json holds besides the user's info


def _abstract_like(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)


class DeployerV04:
    """Redco 0.4.x's ``Deployer`` methods (mixed into ``redco.Deployer``)."""

    def get_local_global_micro_batch_size(self, per_device_batch_size: int) -> tuple[int, int]:
        """``(examples this process collates per step, examples per step in all)``."""
        size = self.get_global_batch_size(per_device_batch_size)
        rows = self._local_rows(size)
        return rows.stop - rows.start, size

    process_batch_size = get_local_global_micro_batch_size  # the 0.4.16 name

    def get_accumulate_grad_batches(self, global_batch_size: int,
                                    per_device_batch_size: int) -> int:
        step = self.get_global_batch_size(per_device_batch_size)
        if global_batch_size % step:
            raise ValueError(
                f"global_batch_size={global_batch_size} is not a multiple of the {step} examples "
                f"one micro-batch of per_device_batch_size={per_device_batch_size} takes on "
                f"{self.dp_size} data-parallel devices.")
        return global_batch_size // step

    def get_params_spec(self, params_shape_or_params: Any, params_sharding_rules: Any) -> Any:
        return specs_from_rules(params_shape_or_params, params_sharding_rules, self.mesh)

    def get_opt_state_spec(self, params_shape_or_params: Any, params_spec: Any, optimizer) -> Any:
        shardings = opt_state_shardings(optimizer, params_shape_or_params,
                                        shardings_from_specs(params_spec, self.mesh), self.mesh)
        return jax.tree.map(lambda s: s.spec, shardings)

    def shard_params(self, params: Any, params_spec: Any, desc: str = "params") -> Any:
        return jax.device_put(params, shardings_from_specs(params_spec, self.mesh))

    def gen_model_step_rng(self) -> jax.Array:
        return self.gen_rng()

    def run_model_step(self, step_fn: Callable, input_args: tuple) -> Any:
        with jax.set_mesh(self.mesh):
            return step_fn(*input_args)

    def save_outputs(self, outputs: list, desc: str, step: int) -> str | None:
        """Write ``outputs`` as ``workdir/outputs_<desc>.json`` (process 0)."""
        path = self.save_json(f"outputs_{desc}.json", jax.tree.map(str, outputs))
        if path:
            self.log_info(f"Outputs ({desc}, step {step}) saved into {path}.")
        return path

    # ---- checkpoints by directory ------------------------------------------------------------
    def load_params_shape(self, ckpt_dir: str) -> dict:
        """The saved params as nested dicts of ``jax.ShapeDtypeStruct``."""
        arrays = checkpointing.read_meta(os.path.abspath(ckpt_dir))["arrays"]
        shapes = {path: jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))
                  for path, (shape, dtype) in arrays.items() if path.startswith("params/")}
        return checkpointing.nest(shapes).get("params", {})

    def _save_ckpt_v04(self, ckpt_dir: str, params: Any, opt_state: Any = None,
                       float_dtype: Any = None, **info) -> str:
        ckpt_dir = os.path.abspath(ckpt_dir)
        tree = {"params": cast_floats(params, float_dtype)}
        if opt_state is not None:
            tree["opt_state"] = cast_floats(opt_state, float_dtype)
        info = {**info, "rng": np.asarray(self._rng).tolist()}
        if self.is_main_process:
            os.makedirs(os.path.dirname(ckpt_dir), exist_ok=True)
        path = checkpointing.save(os.path.dirname(ckpt_dir), os.path.basename(ckpt_dir), tree,
                                  info, self.checkpoint_format)
        self.log_info(f"Ckpt saved into {path}")
        return path

    def _load_ckpt_v04(self, ckpt_dir: str, params_sharding_rules: Any = None, optimizer=None,
                       float_dtype: Any = None, load_params: bool = True,
                       load_opt_state: bool = True, update_rng: bool = False) -> tuple[dict, dict]:
        ckpt_dir = os.path.abspath(ckpt_dir)
        meta = checkpointing.read_meta(ckpt_dir)
        params_shape = self.load_params_shape(ckpt_dir)
        rules = params_sharding_rules if params_sharding_rules is not None else \
            self.get_sharding_rules(params_shape)
        shardings = shardings_from_specs(self.get_params_spec(params_shape, rules), self.mesh)
        target = {}
        if load_params:
            target["params"] = _abstract_like(params_shape, shardings)
        if load_opt_state and optimizer is not None and any(
                p.startswith("opt_state/") for p in meta["arrays"]):
            target["opt_state"] = _abstract_like(
                jax.eval_shape(optimizer.init, params_shape),
                opt_state_shardings(optimizer, params_shape, shardings, self.mesh))
        tree = checkpointing.load(ckpt_dir, target)[0] if target else {}
        ckpt = {key: cast_floats(tree.get(key), float_dtype) for key in ("params", "opt_state")}
        info = {k: v for k, v in meta.items() if k not in META_KEYS}
        if "epoch" in info:  # a checkpoint fit wrote
            info.setdefault("epoch_idx", info["epoch"])
        if "rng" in info:
            info["rng"] = jnp.asarray(info["rng"], jnp.uint32)
            if update_rng:
                self._rng = info["rng"]
        self.log_info(f"Loaded {ckpt_dir} ({', '.join(f'{k} = {v}' for k, v in info.items() if k != 'rng')})")
        return ckpt, info

    def load_last_ckpt(self, optimizer=None, params_sharding_rules: Any = None,
                       float_dtype: Any = None, load_params: bool = True,
                       load_opt_state: bool = True, update_rng: bool = True):
        """The checkpoint in ``workdir/ckpts`` at the latest step (a step checkpoint before a
        ``best_*`` or ``epoch_*`` one of the same step), as ``(ckpt, info)``; ``(None, None)``
        when there is none. ``Trainer(last_ckpt_info=info)`` then goes on from its step."""
        latest = max(self._complete_ckpts(), default=None)
        if latest is None:
            self.log_info(f"No checkpoint in {self.ckpt_dir}: starting from scratch.")
            return None, None
        return self._load_ckpt_v04(latest[-1], params_sharding_rules, optimizer, float_dtype,
                                   load_params, load_opt_state, update_rng)

    def _complete_ckpts(self) -> list[tuple[int, bool, str]]:
        """``(step, is a step checkpoint, path)`` of every complete checkpoint in the workdir."""
        if self.ckpt_dir is None or not os.path.isdir(self.ckpt_dir):
            return []
        found = []
        for name in os.listdir(self.ckpt_dir):
            path = os.path.join(self.ckpt_dir, name)
            if os.path.isfile(os.path.join(path, "meta.json")):
                step = checkpointing.read_meta(path).get("step", -1)
                found.append((step, bool(checkpointing.STEP_DIR.match(name)), path))
        return found


def flax_train_step(train_step_fn: Callable, settings, loss_of: Callable, mesh) -> Callable:
    """A step running a 0.4.x ``train_step_fn(rng, state, batch, loss_fn,
    lr_schedule_fn, mesh, compute_dtype) -> (new_state, metrics)``, where 0.4.23 ran it.

    ``state`` is a Flax ``TrainState`` (``tx`` is the optimizer); the step runs inside this
    package's jitted, donated, resumable loop. With ``n_model_shards=1`` 0.4.23 had no mesh: it
    ran the step under ``jax.pmap(axis_name='dp')`` with ``mesh=None``, each device on its own
    rows with its own rng, the step reducing over ``'dp'`` itself; here it runs the same way,
    under ``shard_map`` over ``dp``. With model shards 0.4.23 passed its mesh and ran the step
    under ``pjit`` on the whole batch, shaped ``(dp, rows per dp group, ...)`` for the step to
    ``vmap`` over; so does this one.
    """
    per_device = mesh.shape["mp"] == 1
    loss = loss_of(per_device)

    def loss_fn(rng, state, params, batch, is_training):
        return loss_and_metrics(loss(params, state, batch, rng, is_training))[0]

    def run(rng, flax_state, batch, step_mesh):
        return train_step_fn(rng=rng, state=flax_state, batch=batch, loss_fn=loss_fn,
                             lr_schedule_fn=settings.lr_schedule_fn, mesh=step_mesh,
                             compute_dtype=settings.compute_dtype or jnp.float32)

    def step(state, batch):
        rng = jax.random.fold_in(state.rng, state.step)
        flax_state = flax.training.train_state.TrainState(
            step=state.step, apply_fn=state.apply_fn, params=state.params,
            tx=settings.optimizer, opt_state=state.opt_state)
        batch = jax.tree.map(lambda x: x[0], batch)  # the one micro-batch: (global rows, ...)
        if per_device:  # pmap's semantics: replicated state, this device's rows, its own rng
            pmapped = jax.shard_map(lambda rngs, s, b: run(rngs[0], s, b, None), mesh=mesh,
                                    in_specs=(P("dp"), P(), P("dp")), out_specs=(P(), P()),
                                    check_vma=False)
            new, metrics = pmapped(jax.random.split(rng, mesh.shape["dp"]), flax_state, batch)
        else:
            batch = jax.tree.map(lambda x: x.reshape((mesh.shape["dp"], -1) + x.shape[1:]), batch)
            new, metrics = run(rng, flax_state, batch, mesh)
        return state.replace(step=new.step, params=new.params, opt_state=new.opt_state), metrics
    return step


def step_maker(train_step_fn: Callable | None) -> Callable | None:
    """``StepSettings.make_step`` for a 0.4.x ``train_step_fn`` (None: redco's own step)."""
    return None if train_step_fn is None else functools.partial(flax_train_step, train_step_fn)


def train_state_options(options: dict, optimizer, apply_fn) -> tuple[Any, Any]:
    """``set_train_state(...)``'s 0.4.x keywords: the new optimizer and model (``apply_fn``)
    given, each None where absent or unchanged."""
    refuse_unknown("set_train_state()", options,
                   {"apply_fn", "optimizer", "params_sharded", "opt_state_sharded"})
    new_optimizer = options.get("optimizer")
    new_apply_fn = options.get("apply_fn")
    return (new_optimizer if new_optimizer is not optimizer else None,
            new_apply_fn if new_apply_fn is not None and new_apply_fn != apply_fn else None)


def ask_planner(planner, deployer, request) -> Any:
    """``planner.plan(deployer, request)``; a planner written before ``LayoutRequest``
    (``plan(deployer, params, loss, batch, optimizer, rule_sets, ...)``) gets those arguments,
    and of ``remat``, ``trainable``, ``accumulate_grad_batches``, ``model_degrees`` and
    ``context_degrees`` those its ``plan`` names."""
    takes = inspect.signature(planner.plan).parameters
    if "request" in takes:
        return planner.plan(deployer, request)
    s = request.settings
    optional = {"remat": s.remat, "trainable": s.trainable,
                "accumulate_grad_batches": s.accumulate_grad_batches,
                "model_degrees": request.model_degrees, "context_degrees": request.context_degrees}
    return planner.plan(deployer, request.params, request.loss, request.batch, s.optimizer,
                        list(request.rule_sets), **{k: v for k, v in optional.items() if k in takes})


def params_for_optimizer(optimizer, params: Any) -> Any:
    """0.4.x froze params before ``optimizer.init``, so its scripts give ``optax.multi_transform``
    frozen labels (``param_labels=freeze(...)``): freeze plain-dict params when only their
    frozen form fits the optimizer."""
    if type(params) is not dict:
        return params
    try:
        jax.eval_shape(optimizer.init, params)
        return params
    except Exception as error:  # noqa: BLE001 - retried frozen; the first error if that fails too
        frozen = flax.core.freeze(params)
        try:
            jax.eval_shape(optimizer.init, frozen)
        except Exception:  # noqa: BLE001
            raise error from None
        return frozen


def accumulates_inside(optimizer, params: Any) -> bool:
    """Whether an ``optax.MultiSteps`` sits inside ``optimizer`` (e.g. under
    ``optax.multi_transform``). 0.4.x's trainer never accumulated: such a MultiSteps did, fed one
    micro-batch per step, so the trainer must not accumulate a second time."""
    def is_multisteps(x):
        return isinstance(x, optax.MultiStepsState)
    state = jax.eval_shape(optimizer.init, params)
    return any(is_multisteps(x) for x in jax.tree.leaves(state, is_leaf=is_multisteps))


def optimizer_and_accumulation(optimizer, params: Any, accumulate_grad_batches: int,
                               train_step_fn, log: Callable) -> tuple[Any, Any, int]:
    """The optimizer the Trainer steps (an outer ``optax.MultiSteps`` unwrapped into its own
    accumulation), the params it takes (``params_for_optimizer``) and the micro-batches it
    accumulates: one where a 0.4 ``train_step_fn`` makes the update or a MultiSteps inside the
    optimizer accumulates them."""
    if train_step_fn is not None:
        if accumulate_grad_batches != 1:
            raise ValueError("A train_step_fn makes one update per batch: pass "
                             "accumulate_grad_batches=1 (or None).")
        return optimizer, params_for_optimizer(optimizer, params), 1
    optimizer = unwrap_multisteps(optimizer, accumulate_grad_batches)
    params = params_for_optimizer(optimizer, params)
    if accumulate_grad_batches > 1 and accumulates_inside(optimizer, params):
        log("An optax.MultiSteps inside the optimizer accumulates the micro-batches, fed one per "
            "step (as Redco 0.4 did).")
        accumulate_grad_batches = 1
    return optimizer, params, accumulate_grad_batches


def trainer_options(options: dict) -> dict:
    """``Trainer(...)``'s 0.4.x keywords as this package's: ``last_ckpt_info`` gives the starting
    step; ``params_sharded``/``opt_state_sharded`` need no saying (placed arrays are seen as
    such)."""
    known = {"params_sharded", "opt_state_sharded", "last_ckpt_info", "train_step_fn"}
    refuse_unknown("Trainer()", options, known)
    info = options.get("last_ckpt_info") or {}
    return {"step": int(info.get("step", 0)), "train_step_fn": options.get("train_step_fn")}


def refuse_unknown(where: str, options: dict, known: set) -> None:
    """A ``TypeError`` naming the first keyword in ``options`` that is not ``known``."""
    for name in options:
        if name not in known:
            raise TypeError(f"{where} got an unexpected keyword argument {name!r}.")


class FitOptionsV04:
    """``fit(...)``'s 0.4.x keywords: a checkpoint ``ckpts/epoch_<i>`` every
    ``save_ckpt_every_k_epochs`` epochs (every epoch with 0.4.17's ``save_every_ckpt=True``;
    params, the optimizer state unless ``save_opt_states=False``, floats cast to
    ``save_float_dtype``)."""

    def __init__(self, save_ckpt_every_k_epochs: int | None = None, save_opt_states: bool = True,
                 save_float_dtype: Any = None, save_every_ckpt: bool = False, **unknown):
        refuse_unknown("fit()", unknown, set())
        self.every_k = save_ckpt_every_k_epochs or (1 if save_every_ckpt else None)
        self.save_opt_states = save_opt_states
        self.float_dtype = save_float_dtype

    @hookimpl
    def on_epoch_end(self, trainer, epoch: int) -> None:
        """(Registered on the trainer's hooks for the fit that asked.)"""
        if self.every_k and (epoch + 1) % self.every_k == 0:
            trainer.save_ckpt(epoch, f"epoch_{epoch}", self.save_opt_states, self.float_dtype)


def call_metric_fn(metric_fn: Callable, examples: list, preds: list) -> dict:
    """``metric_fn`` by its argument names when it calls them ``examples`` and ``preds`` (0.4.x
    passes them so), else positionally ``(examples, preds)``."""
    return by_name(metric_fn, ("examples", "preds"))(examples, preds)


def examples_of_epoch(train_examples: Any, epoch: int):
    """0.4.x's ``train_examples`` may be a function of the epoch index."""
    if callable(train_examples) and not hasattr(train_examples, "__len__"):
        takes_name = "epoch_idx" in inspect.signature(train_examples).parameters
        return train_examples(epoch_idx=epoch) if takes_name else train_examples(epoch)
    return train_examples


class TrainerV04:
    """Redco 0.4.x's ``Trainer`` methods (mixed into ``redco.Trainer``)."""

    def train(self, examples, per_device_batch_size: int, desc: str | None = None) -> None:
        """One shuffled pass over ``examples`` (a new order each call)."""
        self._passes = getattr(self, "_passes", -1) + 1
        self.train_epoch(examples, per_device_batch_size, epoch=self._passes, desc=desc or "")

    def save_ckpt(self, epoch_idx: int, ckpt_name: str, save_opt_state: bool = True,
                  float_dtype: Any = None) -> str:
        """``workdir/ckpts/<ckpt_name>``: the params and, unless ``save_opt_state=False``, the
        optimizer state, floats cast to ``float_dtype``."""
        tree = {"params": cast_floats(self.params, float_dtype)}
        if save_opt_state:
            tree["opt_state"] = cast_floats(self.state.opt_state, float_dtype)
        return self.deployer.save_ckpt(ckpt_name, tree, {"step": self.step, "epoch_idx": epoch_idx})

    def get_params_to_save(self, state_params: Any = None) -> Any:
        return self.params if state_params is None else state_params

    @property
    def mesh(self):
        return self.deployer.mesh

    @property
    def workdir(self) -> str | None:
        return self.deployer.workdir


class PredictorV04:
    """Redco 0.4.x's ``Predictor`` attributes (mixed into ``redco.Predictor``)."""

    @property
    def mesh(self):
        return self.deployer.mesh
