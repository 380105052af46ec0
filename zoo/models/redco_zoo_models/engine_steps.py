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


def prefill_rows(graphdef, slotted, params, cache, key_valid, logits, ids, lengths, starts,
                 rows, copies, n_copies, context=None, *, fresh_only: bool = False):
    """The engine's prefill, each prompt read from an offset into its own row: first, for
    ``j < n_copies[0]``, row ``copies[0, j]`` copied into row ``copies[1, j]`` (a cached
    prefix); then prompt ``p``'s tokens ``ids[p, :lengths[p]]`` read into row ``rows[p]`` at
    slots ``starts[p]`` on, after the keys (or recurrent state) its slots ``[0, starts[p])``
    already hold (a row starting at 0 starts from an empty state; ``rows[p]`` past the last row:
    a padding prompt, written nowhere); last, for ``j < n_copies[1]``, row ``copies[2, j]``
    copied into row ``copies[3, j]`` (a prompt's other samples). The rows are cut out of the
    cache and their slotted leaves padded by ``width`` slots, so that a chunk's padding never
    runs past ``max_len`` (where the model's write would be clamped onto real slots).
    ``context``: an image model's pixels of each prompt's images (``engine_images``).
    ``fresh_only`` (static: every prompt is read whole from slot 0, no chunk or cached prefix
    goes on from slots a row holds): only a row's first ``width`` slots are read and written, its
    ``key_valid`` past them cleared (what the slots there hold is masked), so a short prompt's
    prefill costs its width, not ``max_len``."""
    width, max_len = ids.shape[1], key_valid.shape[1]
    state = copy_rows((cache, key_valid, logits), copies[0], copies[1], n_copies[0])
    cache, key_valid, logits = state
    fresh = starts == 0

    def take(x, has_slots):
        x = jnp.take(x, rows, axis=0, mode="clip")
        if has_slots:
            return x[:, :width] if fresh_only else padded(x, width)
        return state_of(x, fresh)
    read, valid, last = read_prompts(graphdef, params, jax.tree.map(take, cache, slotted), ids,
                                     lengths, starts, 0 if fresh_only else max_len, context)

    def put(full, new, has_slots=True):  # (a fresh row's cache: its first width slots)
        if not has_slots:
            return full.at[rows].set(new.astype(full.dtype), mode="drop")
        new = new[:, :max_len]
        return full.at[rows, :new.shape[1]].set(new.astype(full.dtype), mode="drop")
    if fresh_only:
        valid = jnp.arange(max_len) < lengths[:, None]
    state = (jax.tree.map(put, cache, read, slotted), put(key_valid, valid),
             put(logits, last, False))
    return copy_rows(state, copies[2], copies[3], n_copies[1])


def state_of(x, fresh):
    """Rows' recurrent states ``x`` (rows, ...) as a chunk reads them: empty where ``fresh`` (the
    chunk starts at slot 0), else as the row's last chunk left them."""
    return jnp.where(fresh.reshape((-1,) + (1,) * (x.ndim - 1)), jnp.zeros_like(x), x)


def padded(x, width: int):
    """``x`` (rows, slots, ...) with ``width`` more slots (zeros) at the end."""
    return jnp.pad(x, [(0, 0), (0, width)] + [(0, 0)] * (x.ndim - 2))


def read_prompts(graphdef, params, taken, ids, lengths, starts, max_len: int, context=None):
    """``(cache, key_valid, last logits)`` of the prefill's rows: prompt ``p``'s
    ``ids[p, :lengths[p]]`` read into ``taken`` (the rows' caches, ``max_len + width`` slots)
    from slot ``starts[p]`` on."""
    m = nnx.merge(graphdef, params)
    valid = jnp.arange(max_len + ids.shape[1]) < (starts + lengths)[:, None]
    out, read = m.decode(ids, valid, taken, starts, context)
    return read, valid, jnp.take_along_axis(out, (lengths - 1)[:, None, None], 1)[:, 0]


def copy_rows(tree, sources, targets, n):
    """``tree``'s leaves (rows first) with row ``sources[j]`` copied into row ``targets[j]``
    for ``j < n``, in that order."""
    def put(old):
        def write(j, x):
            row = jax.lax.dynamic_index_in_dim(x, sources[j])
            return jax.lax.dynamic_update_slice_in_dim(x, row, targets[j], 0)
        return jax.lax.fori_loop(0, n, write, old)
    return jax.tree.map(put, tree)


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

    def kept(old, new, has_slots):  # an idle row's slots as they were (a cached prefix, a
        if not has_slots:           # prompt half read), not where its write was clamped to
            return new
        return jnp.where(active.reshape((-1,) + (1,) * (new.ndim - 1)), new, lead(old, True))
    carry = (jax.tree.map(kept, cache, carry[0], slotted), *carry[1:])
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
