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
                active, settings, row_keys, counts):
    """The engine's decode step: ``steps_per_sync`` next tokens of the first ``len(slot)``
    rows of the model ``graphdef`` with ``params``, each sampled its own way: ``(tokens,
    logprobs, logits, cache, key_valid)``, the first two (steps_per_sync, rows) and on every
    device of ``mesh``."""
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

    lead = lambda x: x[:rows]  # noqa: E731
    carry = jax.tree.map(lead, (cache, key_valid, logits))
    carry, (tokens, logprobs) = jax.lax.scan(one_token, carry, jnp.arange(steps_per_sync))
    back = lambda full, part: jax.lax.dynamic_update_slice_in_dim(full, part, 0, 0)  # noqa: E731
    cache, key_valid, logits = jax.tree.map(back, (cache, key_valid, logits), carry)
    return everywhere(mesh, tokens), everywhere(mesh, logprobs), logits, cache, key_valid
