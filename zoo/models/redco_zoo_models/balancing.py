"""DeepSeek-V3's sigmoid routing and its auxiliary-loss-free balancing, moved in training.

**The choice.** Each expert scores ``sigmoid(logit)``. A per-expert bias (``BalanceBias``) is
added to the scores for choosing only: with ``n_group`` groups of experts, a token first keeps
its ``topk_group`` groups of the largest sum of their two best biased scores, then takes its
``top_k`` best biased experts within them. The chosen experts' weights are their scores without
the bias.

**The bias in training.** DeepSeek-V3 moves the bias after each step by ``rate`` against the
step's load: an expert chosen more than the mean goes down, one chosen less goes up
(``updated_balance_bias``). The bias is a param, so that it lives, shards and is saved with the
others, and the step moves it through the ordinary gradient-and-optimizer path with no MoE
knowledge in the trainer:

* the choice is a ``jax.custom_vjp`` (``sigmoid_choice``) whose backward gives the scores their
  true gradient (that of picking the chosen ones' scores) and gives the bias, as its
  "gradient", ``sign(load - mean load)`` of that call's choices, whatever the loss;
* ``moe_optimizer`` gives the bias leaves plain SGD at ``bias_update_rate`` (``optax.
  multi_transform``) and every other leaf the user's optimizer: no weight decay, no moments on
  the bias, and SGD's ``bias - rate * sign(load - mean)`` is DeepSeek-V3's update.

With gradient accumulation the step averages the micro-batches' gradients, so the bias moves by
``rate`` times the mean of their signs. A bias left out of ``Trainer(trainable=)`` (a LoRA run's
frozen base) is not moved. The model called several times in one loss sums the calls' signs.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import optax
from flax import nnx


class BalanceBias(nnx.Param):
    """Sigmoid routing's per-expert bias: read by the choice only, moved by the load
    (``moe_optimizer``), never by the user's optimizer."""


def group_limited_top_k(biased, top_k: int, n_group: int, topk_group: int):
    """``(N, top_k)`` expert ids: the best ``biased`` (N, E) scores within each token's
    ``topk_group`` groups of the largest sum of their two best scores."""
    n, n_experts = biased.shape
    if topk_group < n_group:
        grouped = biased.reshape(n, n_group, n_experts // n_group)
        _, best = jax.lax.top_k(jax.lax.top_k(grouped, 2)[0].sum(-1), topk_group)
        kept = jax.nn.one_hot(best, n_group, dtype=jnp.bool_).any(1)  # (N, n_group)
        biased = jnp.where(jnp.repeat(kept, n_experts // n_group, 1), biased, -jnp.inf)
    return jax.lax.top_k(biased, top_k)[1]


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def sigmoid_choice(scores, bias, top_k: int, n_group: int, topk_group: int):
    """``(weights (N, top_k), chosen (N, top_k))``: the experts chosen by ``scores + bias``
    (``group_limited_top_k``) and their unbiased scores. Backward: module docstring."""
    chosen = group_limited_top_k(scores + bias.astype(scores.dtype), top_k, n_group, topk_group)
    return jnp.take_along_axis(scores, chosen, -1), chosen


def _choice_forward(scores, bias, top_k, n_group, topk_group):
    weights, chosen = sigmoid_choice(scores, bias, top_k, n_group, topk_group)
    return (weights, chosen), (chosen, bias)


def _choice_backward(top_k, n_group, topk_group, residuals, cotangents):
    chosen, bias = residuals
    picked = jax.nn.one_hot(chosen, bias.shape[0], dtype=cotangents[0].dtype)  # (N, k, E)
    scores_grad = jnp.einsum("nke,nk->ne", picked, cotangents[0])
    load = picked.sum((0, 1)).astype(jnp.float32)
    return scores_grad, jnp.sign(load - jnp.mean(load)).astype(bias.dtype)


sigmoid_choice.defvjp(_choice_forward, _choice_backward)


def updated_balance_bias(bias, expert_load, rate: float):
    """DeepSeek-V3's balancing step: each expert's bias moves by ``rate`` against its load's
    side of the mean (overloaded: down, underloaded: up, at the mean: unchanged)."""
    return bias + rate * jnp.sign(jnp.mean(expert_load) - expert_load)


def moe_optimizer(optimizer: optax.GradientTransformation, model: nnx.Module):
    """``optimizer`` for ``model``'s params with every ``BalanceBias`` moved by plain SGD at its
    block's ``bias_update_rate`` instead (module docstring); ``optimizer`` itself for a model
    without one. The labels follow the params' tree (``nnx.State`` or a plain dict of it)."""
    rates = {tuple(map(str, path)): module.cfg.bias_update_rate
             for path, module in nnx.iter_graph(model)
             if isinstance(getattr(module, "balance_bias", None), BalanceBias)}
    if not rates:
        return optimizer

    def label(path, _):
        keys = tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        if "balance_bias" not in keys:
            return "rest"
        return f"bias {rates[keys[:keys.index('balance_bias')]]}"
    labels = lambda params: jax.tree_util.tree_map_with_path(label, params)  # noqa: E731
    transforms = {f"bias {rate}": optax.sgd(rate) for rate in set(rates.values())}
    return optax.multi_transform({**transforms, "rest": optimizer}, labels)
