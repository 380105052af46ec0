"""Placing a trainer's state on the mesh, once its layout is decided (``Trainer.prepare``).

The shardings (``state_shardings``): params by the layout's rules; the optimizer state as the
params it tracks (``opt_state_shardings``; only for the trainable ones); step and rng
replicated. The state (``initial_state``): the params copied onto those shardings, a fresh
``optimizer.init`` run on the mesh (so each device makes only its own shards) unless a state was
given, step and ``PRNGKey(jax_seed)`` replicated. Copies, because the train step donates its
state: a caller's array must not be deleted under it.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from redco.deployer import Deployer
from redco.sharding import Rules, opt_state_shardings
from redco.train_step import TrainState, loss_and_metrics, split


def place_copy(tree: Any, shardings: Any) -> Any:
    """``tree`` placed by ``shardings`` in buffers of its own. The train step donates its state,
    and ``device_put`` can reuse a caller's device array as a shard (then deleted), so what came
    in on a device is copied once placed: a shard's worth per device, not a whole array."""
    placed = jax.device_put(tree, shardings)
    return jax.tree.map(lambda x, y: jnp.copy(y) if isinstance(x, jax.Array) else y, tree, placed)


def state_shardings(deployer: Deployer, params: Any, rules: Rules, optimizer, trainable: Any,
                    apply_fn: Callable) -> TrainState:
    """How each part of the state is laid out on ``deployer``'s mesh."""
    params_shardings = deployer.get_params_shardings(params, rules)
    return TrainState(step=deployer.replicated, params=params_shardings, rng=deployer.replicated,
                      opt_state=optimizer_shardings(deployer, optimizer, params, params_shardings,
                                                    trainable),
                      apply_fn=apply_fn)


def optimizer_shardings(deployer: Deployer, optimizer: optax.GradientTransformation, params: Any,
                        params_shardings: Any, trainable: Any) -> Any:
    """The optimizer state's shardings: as the trainable params it tracks."""
    return opt_state_shardings(optimizer, split(params, trainable)[0],
                               split(params_shardings, trainable)[0], deployer.mesh)


def placed_step(deployer: Deployer, step) -> jax.Array:
    return jax.device_put(jnp.asarray(step, jnp.int32), deployer.replicated)


def initial_state(deployer: Deployer, shardings: TrainState, params: Any, opt_state: Any,
                  step, optimizer, trainable: Any) -> TrainState:
    """The state placed by ``shardings``: params, optimizer state (fresh when None), step, the
    deployer's rng."""
    rng = jax.device_put(jax.random.PRNGKey(deployer.jax_seed), deployer.replicated)
    state = TrainState(step=placed_step(deployer, step), params=None, opt_state=None, rng=rng,
                       apply_fn=shardings.apply_fn)
    return with_params(state, shardings, params, opt_state, optimizer, trainable)


def with_params(state: TrainState, shardings: TrainState, params: Any, opt_state: Any,
                optimizer, trainable: Any) -> TrainState:
    """``state`` holding ``params`` and ``opt_state`` (a fresh ``optimizer.init`` when None)
    placed by ``shardings``, in buffers of their own."""
    params = place_copy(params, shardings.params)
    if opt_state is None:
        opt_state = jax.jit(optimizer.init, out_shardings=shardings.opt_state)(
            split(params, trainable)[0])
    else:
        opt_state = place_copy(opt_state, shardings.opt_state)
    return state.replace(params=params, opt_state=opt_state)


def check_traced_loss(out: Any, remat: str | None, layers_before: int, layers_after: int) -> None:
    """``loss_fn``'s output traced on a batch's shapes: a scalar, or a clear error; a warning
    when a remat policy was asked and the loss ran no ``redco.remat.layer``."""
    if remat not in (None, "none") and layers_after == layers_before:
        warnings.warn(f"Trainer(remat={remat!r}) rematerialises nothing: loss_fn runs no "
                      "redco.remat.layer. Wrap each block of the model with it (the zoo's "
                      "models are); a checkpoint around the whole loss would save no memory.",
                      stacklevel=4)
    loss, metrics = loss_and_metrics(out)
    if not (isinstance(loss, jax.ShapeDtypeStruct) and loss.shape == ()):
        shape = loss.shape if isinstance(loss, jax.ShapeDtypeStruct) else type(loss).__name__
        raise ValueError(f"loss_fn must return a scalar, but returned {shape}. Reduce it, e.g. "
                         "with jnp.mean(...), before returning (with metrics to log: "
                         "(loss, {name: scalar})).")
    wrong = {name: getattr(value, "shape", type(value).__name__)
             for name, value in metrics.items() if getattr(value, "shape", None) != ()}
    if wrong or {"loss", "grad_norm", "lr", "tokens"} & set(metrics):
        raise ValueError(f"loss_fn's metrics must be scalars under names of your own (not loss, "
                         f"grad_norm, lr or tokens): {wrong or sorted(metrics)}. Reduce each, "
                         "e.g. with jnp.mean(...), or rename it.")
