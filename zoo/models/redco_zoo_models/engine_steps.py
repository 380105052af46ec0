"""What the engine (``redco_zoo_models.engine``) runs on the devices, jitted there: the prefill
that reads admitted prompts into their cache rows, and the decode step that makes
``steps_per_sync`` tokens of every running row, each sampled its own way
(``generation.pick_rows``). Module functions of the model's graph and the arrays they are
given, so that ``redco_zoo_models.decode_layout`` can compile the decode step ahead of time on
abstract shapes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from redco_zoo_models.engine_memory import traced
from redco_zoo_models.generation import pick_rows


def prefill_rows(graphdef, max_len: int, cache_dtype, params, cache, key_valid, logits, ids,
                 lengths, sources, targets, n_rows):
    """The engine's prefill: the prompts ``ids`` (P, width; row ``p``'s first ``lengths[p]``
    real) read into a P-row cache of ``max_len`` slots; for ``j < n_rows``, prompt
    ``sources[j]``'s cache, key mask and last logits copied into row ``targets[j]``."""
    m = nnx.merge(graphdef, params)
    valid = jnp.arange(max_len)[None] < lengths[:, None]
    out, read = m.decode(ids, valid, m.init_cache(len(ids), max_len, cache_dtype), 0)
    last = jnp.take_along_axis(out, (lengths - 1)[:, None, None], 1)[:, 0]

    def put(new, old):
        def write(j, x):
            row = jax.lax.dynamic_index_in_dim(new, sources[j]).astype(x.dtype)
            return jax.lax.dynamic_update_slice_in_dim(x, row, targets[j], 0)
        return jax.lax.fori_loop(0, n_rows, write, old)
    return (jax.tree.map(put, read, cache), put(valid, key_valid),
            put(last.astype(jnp.float32), logits))


def everywhere(mesh, x):
    """``x`` on every device of ``mesh``, so that each process reads it whole."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P()))


def decode_rows(graphdef, steps_per_sync: int, mesh, params, cache, key_valid, logits, slot,
                active, settings, row_keys, counts, slotted=None, span: int | None = None):
    """The engine's decode step: ``steps_per_sync`` next tokens of the first ``len(slot)``
    rows of the model ``graphdef`` with ``params``, each sampled its own way: ``(tokens,
    logprobs, logits, cache, key_valid)``, the first two (steps_per_sync, rows) and on every
    device of ``mesh``. With ``span``, attention reads only the first ``span`` slots (every
    running row's tokens lie there): the cache leaves that ``slotted`` (a tree of bools like the
    cache) marks are cut to them, so a step costs what the rows hold, not ``max_len``."""
    m, rows = nnx.merge(graphdef, params), len(slot)
    temperature, top_k, top_p = settings[0], settings[1].astype(jnp.int32), settings[2]
    scale = jnp.where(temperature > 0, temperature, 1.0)[:, None]

    def one_token(carry, j):
        cache, key_valid, logits = carry
        keys = jax.vmap(jax.random.fold_in)(row_keys, counts + j)
        tokens = pick_rows(logits, keys, temperature, top_k, top_p)
        logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits / scale),
                                       tokens[:, None], -1)[:, 0]
        key_valid = key_valid.at[jnp.arange(rows), slot + j].set(active)
        out, cache = m.decode(tokens[:, None], key_valid, cache, slot + j)
        return (cache, key_valid, out[:, -1].astype(jnp.float32)), (tokens, logprobs)

    def lead(x, has_slots=False):  # the running rows (and with a span, their slots)
        return x[:rows, :span] if has_slots and span else x[:rows]
    slotted = jax.tree.map(lambda _: False, cache) if slotted is None else slotted
    carry = (jax.tree.map(lead, cache, slotted), lead(key_valid, True), lead(logits))
    carry, (tokens, logprobs) = jax.lax.scan(one_token, carry, jnp.arange(steps_per_sync))
    back = lambda full, part: jax.lax.dynamic_update_slice(  # noqa: E731
        full, part, (0,) * full.ndim)
    cache, key_valid, logits = jax.tree.map(back, (cache, key_valid, logits), carry)
    return everywhere(mesh, tokens), everywhere(mesh, logprobs), logits, cache, key_valid


def slotted_leaves(model, max_len: int, cache_dtype) -> list:
    """Which leaves of ``model.init_cache`` have a slot axis (axis 1, growing with ``max_len``),
    as a tree of bools like the cache: a linear layer's fixed-size state has none."""
    a, b = (traced(model, lambda m, n=n: m.init_cache(1, n, cache_dtype))
            for n in (max_len, max_len + 1))
    return jax.tree.map(lambda x, y: x.shape != y.shape, a, b)
