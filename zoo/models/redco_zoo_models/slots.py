"""An MoE block's capacity slots: each (token, choice) pair gets a row in an ``(E, C, H)`` buffer,
expert ``e``'s ``C`` rows, or none when its expert is full (the pair is dropped).

``slots`` decides the rows: first choices first, then in token order. ``dispatch`` writes each
token into its pairs' rows and ``combine`` reads each token's rows back, weighted by the router.

Both moves are gathers, forward and backward. Pairs and rows match one to one, at most one pair
a row. So ``dispatch`` (rows from tokens) and the unweighted ``combine`` (tokens from rows, summed
over a token's ``k`` pairs) are each other's transposes. Each one's gradient is the other move,
through ``jax.custom_vjp``. Autodiff would instead transpose each gather into a scatter-add,
which XLA:CPU runs serially: ``combine`` forward and backward at 4,096 tokens, hidden 512 and 8
experts took 37-58 ms with the scatter-add and 9-25 ms with gathers on this project's loaded
2-core box. Within a whole MoE training step the difference is below that box's noise.

A dropped pair, or a padding token's (expert id ``E``), has row ``E*C``, one past the end. The
gathers read a row of zeros there.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def slots(chosen, n_experts: int, capacity: int):
    """``(places, kept)``: each (token, choice) pair's row (n, k) in a buffer of ``capacity``
    rows an expert (expert e's: ``e*C .. e*C + C - 1``), filled first choices first, then in
    token order; ``E*C`` (past the end) for a pair over capacity. ``kept``: pairs with a row."""
    n, k = chosen.shape
    picked = jax.nn.one_hot(chosen.T, n_experts, dtype=jnp.int32)  # (k, n, E); id E: all 0
    slot = (jnp.cumsum(picked.reshape(k * n, n_experts), axis=0) - 1).reshape(k, n, n_experts)
    slot = jnp.sum(slot * picked, axis=-1).T  # (n, k): the pair's slot at its expert
    end = n_experts * capacity
    places = jnp.where(slot < capacity, chosen * capacity + slot, end)
    return places, jnp.sum(places < end)  # (a padding token's id E: place E*C, none kept)


def dispatch(tokens, places, n_experts: int, capacity: int, weights=None):
    """The (E, C, H) buffer: each token written into its pairs' rows (``slots``), each row
    scaled by its pair's router weight when ``weights`` (n, k) are given (Llama 4's experts
    read router-scaled inputs; ``combine`` then takes weights of one)."""
    pairs = _pair_of_row(places, n_experts * capacity)
    rows = _to_rows(tokens, _token_of(pairs, places), places)
    if weights is not None:
        rows = rows * _take(weights.reshape(-1), pairs).astype(rows.dtype)[:, None]
    return rows.reshape(n_experts, capacity, -1)


def combine(out, places, weights):
    """Each token's output (n, H): its pairs' rows of the experts' ``out`` (E, C, H), weighted
    by the router (a dropped pair reads a row of zeros)."""
    rows = out.reshape(-1, out.shape[-1])
    pairs = _pair_of_row(places, rows.shape[0])
    weight_of_row = _take(weights.reshape(-1), pairs).astype(out.dtype)
    return _to_tokens(rows * weight_of_row[:, None], places, _token_of(pairs, places))


def _pair_of_row(places, n_rows: int):
    """(n_rows,): the pair (``token * k + choice``) each row holds; ``n * k`` for an empty row."""
    n_pairs = places.size
    owner = jnp.full(n_rows + 1, n_pairs, places.dtype)  # + 1: where dropped pairs land
    return owner.at[places.reshape(-1)].set(jnp.arange(n_pairs, dtype=places.dtype))[:-1]


def _token_of(pairs, places):
    """The token each row holds (``n``, one past the tokens, for an empty row)."""
    n, k = places.shape
    return jnp.where(pairs < n * k, pairs // k, n)


def _take(x, index):
    """``x``'s rows at ``index``; index ``len(x)`` reads zeros."""
    return jnp.concatenate([x, jnp.zeros_like(x[:1])])[index]


@jax.custom_vjp
def _to_rows(tokens, token_of_row, places):
    return _take(tokens, token_of_row)


@jax.custom_vjp
def _to_tokens(rows, places, token_of_row):
    return jnp.sum(_take(rows, places), axis=1)


def _to_rows_forward(tokens, token_of_row, places):
    return _to_rows(tokens, token_of_row, places), (token_of_row, places)


def _to_rows_backward(saved, grad_rows):
    token_of_row, places = saved
    return _to_tokens(grad_rows, places, token_of_row), None, None


def _to_tokens_forward(rows, places, token_of_row):
    return _to_tokens(rows, places, token_of_row), (places, token_of_row)


def _to_tokens_backward(saved, grad_tokens):
    places, token_of_row = saved
    return _to_rows(grad_tokens, token_of_row, places), None, None


_to_rows.defvjp(_to_rows_forward, _to_rows_backward)
_to_tokens.defvjp(_to_tokens_forward, _to_tokens_backward)
