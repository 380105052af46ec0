"""The user code of ``examples/differential_private_training/dp_utils.py`` (tanyuqian/redco),
written anew for test_differential_private_training.py.

* ``dp_train_step``: a Redco 0.4 ``train_step_fn``. 0.4's Trainer calls it as
  ``train_step_fn(rng, state, batch, loss_fn=, lr_schedule_fn=, mesh=, compute_dtype=)`` with a
  Flax ``TrainState`` (``state.apply_gradients`` runs the optimizer) and expects
  ``(new_state, metrics)``. With ``mesh=None`` (``n_model_shards=1``) it runs under
  ``jax.pmap(axis_name='dp')`` on one device's examples; with a mesh, under pjit, on the whole
  batch with leaves shaped ``(dp, per_dp_batch, ...)``. Either way it takes one gradient per
  example and hands the stack, leading axis = every example of the global batch, to the
  optimizer, whose first transform (``optax.contrib.differentially_private_aggregate``) clips each,
  sums them, adds Gaussian noise and divides by the batch size (DP-SGD).
* ``compute_epsilon`` / ``get_noise_multiplier_by_epsilon``: the privacy budget of that many
  Poisson-subsampled Gaussian steps, by Renyi DP at integer orders (Mironov, Talwar & Zhang 2019,
  exact for integer orders; conversion to (eps, delta) by Balle et al. 2020), in place of the
  example's ``dp_accounting`` dependency; and the bisection that finds the noise for a budget.
* ``TRACES``: what each trace of ``dp_train_step`` saw, for the test to check that Trainer used it.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from scipy.special import gammaln, logsumexp

ORDERS = np.arange(2, 257)
TRACES: list[dict] = []


def _log_a(q: float, sigma: float, alpha: int) -> float:
    """log E[(p1/p0)^alpha] for the Gaussian mixture of a Poisson-sampled step (integer alpha)."""
    k = np.arange(alpha + 1)
    log_binom = gammaln(alpha + 1) - gammaln(k + 1) - gammaln(alpha - k + 1)
    with np.errstate(divide='ignore'):
        terms = log_binom + k * np.log(q) + (alpha - k) * np.log1p(-q) + (k * k - k) / (2 * sigma ** 2)
    return float(logsumexp(terms))


def compute_epsilon(steps, num_examples, batch_size, noise_multiplier, target_delta):
    """Epsilon of ``steps`` DP-SGD steps at sampling rate ``batch_size / num_examples``."""
    q = batch_size / float(num_examples)
    if noise_multiplier <= 0:
        return math.inf
    best = math.inf
    for alpha in ORDERS:
        rdp = steps * (alpha * 0.5 / noise_multiplier ** 2 if q >= 1 else
                       _log_a(q, noise_multiplier, int(alpha)) / (alpha - 1))
        eps = rdp + math.log1p(-1 / alpha) - (math.log(target_delta) + math.log(alpha)) / (alpha - 1)
        best = min(best, eps)
    return max(best, 0.0)


def get_noise_multiplier_by_epsilon(epsilon, steps, num_examples, batch_size, target_delta=1e-5,
                                    low=0., high=100., n_attempts=60):
    """The smallest noise multiplier (by bisection) whose epsilon is at most ``epsilon``; returns
    ``(noise_multiplier, its epsilon)``."""
    def eps_of(sigma):
        return compute_epsilon(steps=steps, num_examples=num_examples, batch_size=batch_size,
                               noise_multiplier=sigma, target_delta=target_delta)
    for _ in range(n_attempts):
        mid = (low + high) / 2.
        low, high = (mid, high) if eps_of(mid) > epsilon else (low, mid)
    return high, eps_of(high)


def dp_train_step(rng, state, batch, loss_fn, lr_schedule_fn, mesh, compute_dtype):
    """Redco 0.4's default train step with one gradient per example instead of per batch."""
    params = jax.tree.map(lambda x: x.astype(compute_dtype), state.params)

    def example_loss(params_, rng_, example):
        one = jax.tree.map(lambda x: x[None], example)
        return loss_fn(rng=rng_, state=state, params=params_, batch=one, is_training=True)

    per_example = jax.vmap(jax.value_and_grad(example_loss), in_axes=(None, None, 0))
    if mesh is None:  # pmap: this device's examples; gather every device's per-example grads
        losses, grads = per_example(params, rng, batch)
        losses, grads = jax.lax.all_gather((losses, grads), axis_name='dp', tiled=True)
    else:  # pjit: leaves are (dp, per_dp_batch, ...); one rng per data-parallel group
        rngs = jax.random.split(rng, num=mesh.shape['dp'])
        losses, grads = jax.vmap(per_example, in_axes=(None, 0, 0))(params, rngs, batch)
        losses, grads = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), (losses, grads))
    TRACES.append({'state_type': type(state).__name__, 'mesh': mesh,
                   'n_per_example_grads': jax.tree.leaves(grads)[0].shape[0]})

    new_state = state.apply_gradients(grads=jax.tree.map(
        lambda grad, param: grad.astype(param.dtype), grads, state.params))
    per_example_norms = jnp.sqrt(sum(jnp.sum(g.reshape(g.shape[0], -1) ** 2, axis=1)
                                     for g in jax.tree.leaves(grads)))
    metrics = {'loss': losses.mean(), 'step': state.step, 'grad_norm': per_example_norms.mean()}
    if lr_schedule_fn is not None:
        metrics['lr'] = lr_schedule_fn(state.step)
    return new_state, metrics
