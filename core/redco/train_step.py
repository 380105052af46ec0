"""The train step, built once from plain parts, for ``Trainer`` and the layout planner alike.

``make_train_step(loss, optimizer, ...)`` returns a pure ``step(state, batch) -> (state,
metrics)``: value and gradient of the loss over ``accumulate_grad_batches`` micro-batches (the
batch's leading axis), summed in a ``scan`` and averaged; gradients of the trainable leaves only
(a frozen base has none); one optimizer update. The planner compiles this same function to
measure a layout, so what it measures is what trains. ``step_loss`` puts the user's loss in its
context: params cast to the compute dtype, the remat policy in force, FSDP-sharded weights
gathered layer by layer.
"""
from __future__ import annotations

from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import optax

from redco import _private, fsdp, lora, sequence_split
from redco import remat as redco_remat
from redco.data import cast_floats


@flax.struct.dataclass
class TrainState:
    """What ``loss_fn`` sees as ``state``: ``state.apply_fn`` is the model given to Trainer.
    Step ``i`` draws its randomness from ``fold_in(rng, i)``."""
    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array
    apply_fn: Callable = flax.struct.field(pytree_node=False)


def compiler_options() -> dict[str, str] | None:
    """XLA options for compiling a train step ahead of time to read what a device holds
    (``Lowered.compile(compiler_options=...)``: ``Trainer.compile_train_step``, the planner). On
    CPU, no merging of the step's all-reduces: XLA's CPU backend merges every all-reduce of a step,
    whatever its size, into one at the end (its ``cpu-all-reduce-combiner`` pass), so under FSDP
    every layer's full-size gradient is held until the last layer's is made (zoo LLaMA, width
    512, 4 layers, one 256-token row per device, 8 devices, ``auto+fsdp``, full remat: temp
    104 MB, 63 MB without it). GPU backends merge only up to a size threshold, which is what the
    CPU compile stands in for. The steps a run executes compile without these options: on CPU the
    merged all-reduces are faster (103 apart against 20 merged in ``bench/trainer_vs_jit.py``'s
    4-layer step), and a CPU host's memory is not what the accounting is for."""
    if jax.default_backend() == "cpu":
        return {"xla_disable_hlo_passes": "cpu-all-reduce-combiner"}
    return None


def check_trainable(trainable: Any, params: Any, train_step_fn: Callable | None) -> Any:
    """``Trainer(trainable=)``, checked against the params (None: everything trains)."""
    if trainable is None:
        return None
    if train_step_fn is not None:
        raise ValueError("trainable= freezes params in Trainer's own step; a train_step_fn "
                         "makes its own update: freeze them there (optax.multi_transform).")
    if jax.tree.structure(params) != jax.tree.structure(trainable):
        raise ValueError("trainable must be a pytree of bools shaped like params (e.g. "
                         "redco.lora.trainable_mask(params)); its structure differs: "
                         f"{jax.tree.structure(trainable)} vs {jax.tree.structure(params)}.")
    if not any(bool(m) for m in jax.tree.leaves(trainable)):
        raise ValueError("trainable marks no param as trainable: nothing would train.")
    return trainable


def unwrap_multisteps(optimizer: optax.GradientTransformation,
                      accumulate_grad_batches: int) -> optax.GradientTransformation:
    """The step accumulates micro-batches itself; an ``optax.MultiSteps`` wrapper (as in the
    paper's script) would accumulate a second time, so take its inner optimizer instead."""
    if not isinstance(optimizer, optax.MultiSteps):
        return optimizer
    every_k = _private.multisteps_every_k(optimizer)
    if every_k != accumulate_grad_batches:
        raise ValueError(f"optax.MultiSteps(every_k_schedule={every_k}) disagrees with "
                         f"accumulate_grad_batches={accumulate_grad_batches}. Pass the plain "
                         "optimizer and set accumulate_grad_batches only.")
    return optimizer.inner_opt


def split(tree: Any, trainable: Any) -> tuple[Any, Any]:
    """``(trainable part, frozen part)`` of a params-shaped tree (frozen None: no mask)."""
    return (tree, None) if trainable is None else lora.partition(tree, trainable)


def input_tokens(batch: dict) -> int | None:
    """The default token count of a batch: every position of ``input_ids`` (and of
    ``decoder_input_ids``, an encoder-decoder's), padding included; None without them."""
    names = [n for n in ("input_ids", "decoder_input_ids") if isinstance(batch, dict) and n in batch]
    return sum(batch[n].size for n in names) if names else None


def loss_and_metrics(out: Any) -> tuple[Any, dict]:
    """``loss_fn``'s output as ``(loss, metrics)``: it returns the scalar loss, or ``(loss,
    {name: scalar})``, whose scalars are logged with each update's metrics (averaged over its
    micro-batches) and left out of the gradient."""
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
        return out
    return out, {}


def count_tokens_of(batch: Any, count_tokens: Callable | None) -> jax.Array | None:
    """``count_tokens(micro_batch)`` summed over the batch's micro-batches (leading axis), as
    an int32; None where there is no counter or it returns None for this batch."""
    if count_tokens is None or jax.eval_shape(count_tokens, jax.tree.map(lambda x: x[0], batch)) is None:
        return None
    return jnp.sum(jax.vmap(lambda b: jnp.asarray(count_tokens(b), jnp.int32))(batch))


def step_loss(loss_fn: Callable, params_shardings: Any = None, compute_dtype: Any = None,
              remat: str | None = None, mesh: Any = None,
              context_strategy: str = "all_gather") -> Callable:
    """``loss(params, state, batch, rng, is_training)``: ``loss_fn(rng, state, params, batch,
    is_training)`` on params cast to ``compute_dtype``, under the ``remat`` policy (None: the
    one in force), with weights sharded over ``dp`` gathered as used (``params_shardings``)
    and, where ``mesh`` has a ``cp`` axis, the sequence split over it (``sequence_split``)."""
    def loss(params, state, batch, rng, is_training: bool):
        params = cast_floats(params, compute_dtype)
        batch = jax.tree.map(lambda x: x, batch)  # a fresh dict: loss_fn may pop from it
        with redco_remat.policy(remat), fsdp.gathering(params, params_shardings), \
                sequence_split.splitting(mesh, context_strategy):
            return loss_fn(rng, state, params, batch, is_training)
    return loss


def make_train_step(loss: Callable, optimizer: optax.GradientTransformation,
                    trainable: Any = None, accumulate_grad_batches: int = 1,
                    lr_schedule_fn: Callable | None = None,
                    count_tokens: Callable | None = None, unroll: bool = False) -> Callable:
    """``step(state, batch) -> (state, metrics)``: one optimizer update over the batch's
    ``accumulate_grad_batches`` micro-batches (its leading axis). ``loss`` is
    ``loss(params, state, batch, rng, is_training)`` (see ``step_loss``); ``metrics`` holds
    ``loss``, ``grad_norm``, ``lr`` (with ``lr_schedule_fn``) and ``tokens`` (see
    ``count_tokens_of``). ``unroll`` unrolls the loop over micro-batches (XLA's cost analysis
    counts a loop's body once: an unrolled step's FLOPs are the whole update's)."""
    def step(state: TrainState, batch):
        rng = jax.random.fold_in(state.rng, state.step)
        train, frozen = split(state.params, trainable)  # only the trainable part is differentiated
        join = (lambda t: t) if frozen is None else (lambda t: lora.combine(t, frozen))
        grad_fn = jax.value_and_grad(lambda t, *args: loss_and_metrics(loss(join(t), *args)),
                                     has_aux=True)
        if accumulate_grad_batches == 1:
            (value, extra), grads = grad_fn(train, state, jax.tree.map(lambda x: x[0], batch),
                                            rng, True)
        else:
            def micro_step(carry, inputs):
                i, micro_batch = inputs
                out = grad_fn(train, state, micro_batch, jax.random.fold_in(rng, i), True)
                return jax.tree.map(lambda a, b: a + b.astype(a.dtype), carry, out), None
            value_and_extra = jax.eval_shape(  # the forward's only (is_training: a bool)
                lambda t, *args: loss_and_metrics(loss(join(t), *args, True)), train, state,
                jax.tree.map(lambda x: x[0], batch), rng)
            zeros = (jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), value_and_extra),
                     jax.tree.map(jnp.zeros_like, train))
            indices = jnp.arange(accumulate_grad_batches)
            ((value, extra), grads), _ = jax.lax.scan(micro_step, zeros, (indices, batch),
                                                      unroll=unroll)
            value, extra, grads = jax.tree.map(lambda x: x / accumulate_grad_batches,
                                               (value, extra, grads))
        updates, opt_state = optimizer.update(grads, state.opt_state, train)
        params = join(optax.apply_updates(train, updates))
        metrics = {**extra, "loss": value, "grad_norm": optax.global_norm(grads)}
        if lr_schedule_fn is not None:
            metrics["lr"] = lr_schedule_fn(state.step)
        tokens = count_tokens_of(batch, count_tokens)
        if tokens is not None:
            metrics["tokens"] = tokens
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics
    return step
