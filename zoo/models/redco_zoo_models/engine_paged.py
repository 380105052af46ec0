"""What the engine runs on the devices with a paged key/value cache (``Engine(page_size=...)``;
the page tables: ``redco_zoo_models.pages``).

The cache is a pool: ``model.init_cache(n_pages, page_size)``, each slotted leaf (pages,
page_size, ...) in place of (rows, max_len, ...). A step gathers each row's pages through its page
table into the contiguous slots the model's ``decode`` reads (``jnp.take`` over the pool; a
table entry past the pool reads zeros, which the key mask hides), runs the slot engine's own
prefill or decode on them (``engine_steps``), and writes back what it wrote: the decode step
its ``steps_per_sync`` new slots of each running row, the prefill the pages of the rows it read.
A page two rows share (a prompt's whole pages, shared by its samples) is only ever read
there: no row writes before the slot it starts decoding at. So the model code is the slot
engine's; only the cache's storage changes, and the gathered slots live only during a step.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from redco_zoo_models.engine_steps import copy_rows, decode_rows, padded, read_prompts, state_of


def pool_of(model, slotted, n_pages: int, page_size: int, max_seqs: int, dtype):
    """The paged cache: each leaf with slots (``slotted``) a pool (n_pages, page_size, ...),
    each recurrent state a row's own (max_seqs, ...)."""
    pages, rows = (model.init_cache(n, page_size, dtype) for n in (n_pages, max_seqs))
    return jax.tree.map(lambda has_slots, p, r: p if has_slots else r, slotted, pages, rows)


def gathered(pool, table, n_slots: int, slotted):
    """The first ``n_slots`` slots of each row whose pages ``table`` (rows, pages) lists, out
    of ``pool``'s leaves (pages, page_size, ...): (rows, n_slots, ...); no page: zeros. A leaf
    that ``slotted`` marks False (a recurrent state): its first rows."""
    return jax.tree.map(lambda x, has_slots: _page_rows(x, table, n_slots) if has_slots
                        else x[:table.shape[0]], pool, slotted)


def _page_rows(x, table, n_slots: int):
    """One pool leaf's pages listed by ``table``, as rows of their first ``n_slots`` slots."""
    pages = jnp.take(x, table, axis=0, mode="fill", fill_value=0)
    return pages.reshape(table.shape[0], -1, *x.shape[2:])[:, :n_slots]


def _pool_shape(pool, slotted) -> tuple[int, int]:
    """The pool's ``(n_pages, page_size)``, read off its first paged leaf."""
    return next(x for x, s in zip(jax.tree.leaves(pool), jax.tree.leaves(slotted)) if s).shape[:2]


def paged_decode(graphdef, steps_per_sync: int, mesh, params, pool, key_valid, logits, slot,
                 active, settings, row_keys, counts, table, span: int, slotted):
    """``decode_rows`` over the first ``len(slot)`` rows' pages (their first ``span`` slots,
    gathered), each running row's ``steps_per_sync`` new slots written back into its pages (a
    recurrent state: its row): ``(tokens, logprobs, logits, pool, key_valid)``."""
    (n_pages, page), rows = _pool_shape(pool, slotted), len(slot)
    table = table[:rows, :-(-span // page)]
    view = gathered(pool, table, span, slotted)
    tokens, logprobs, logits, view, key_valid = decode_rows(
        graphdef, steps_per_sync, mesh, params, view, key_valid, logits, slot, active,
        settings, row_keys, counts, slotted=slotted, span=span)
    slots = slot[:, None] + jnp.arange(steps_per_sync)  # (rows, steps)
    written = jnp.minimum(slots, span - 1)
    pages = jnp.take_along_axis(table, written // page, axis=1)
    pages = jnp.where(active[:, None] & (slots < span), pages, n_pages)

    def put(x, new, has_slots):
        if not has_slots:
            return jax.lax.dynamic_update_slice(x, new.astype(x.dtype), (0,) * x.ndim)
        new = jnp.take_along_axis(new, written.reshape(written.shape + (1,) * (new.ndim - 2)), 1)
        return x.at[pages, written % page].set(new.astype(x.dtype), mode="drop")
    return tokens, logprobs, logits, jax.tree.map(put, pool, view, slotted), key_valid


def paged_prefill(graphdef, params, pool, key_valid, logits, ids, lengths, starts, rows, copies,
                  n_copies, table, page_copies, n_page_copies, slotted):
    """``prefill_rows`` on pages: each prompt's chunk read into row ``rows[p]`` through its page
    table, the row's pages written back; then, for ``j < n_page_copies``, page
    ``page_copies[0, j]`` copied into page ``page_copies[1, j]`` (a prompt's last partial page,
    into each other sample's own) and row ``copies[2, j]``'s key mask, logits and recurrent
    states into row ``copies[3, j]`` for ``j < n_copies[1]`` (``copies[:2]``, a cached
    prefix's, are unused). A recurrent state is read from its row (empty when the chunk starts
    at slot 0), as ``prefill_rows`` reads it."""
    (n_pages, _), max_len, fresh = _pool_shape(pool, slotted), key_valid.shape[1], starts == 0
    row_pages = jnp.take(table, rows, axis=0, mode="fill", fill_value=n_pages)

    def take(x, has_slots):
        if has_slots:
            return padded(_page_rows(x, row_pages, max_len), ids.shape[1])
        return state_of(jnp.take(x, rows, axis=0, mode="clip"), fresh)
    read, valid, last = read_prompts(graphdef, params, jax.tree.map(take, pool, slotted), ids,
                                     lengths, starts, max_len)

    def put(x, new, has_slots):
        if not has_slots:
            return copy_rows(x.at[rows].set(new.astype(x.dtype), mode="drop"), copies[2],
                             copies[3], n_copies[1])
        new = new[:, :row_pages.shape[1] * x.shape[1]].reshape(*row_pages.shape, *x.shape[1:])
        return copy_rows(x.at[row_pages].set(new.astype(x.dtype), mode="drop"), page_copies[0],
                         page_copies[1], n_page_copies)
    pool = jax.tree.map(put, pool, read, slotted)
    key_valid = key_valid.at[rows].set(valid[:, :max_len], mode="drop")
    logits = logits.at[rows].set(last.astype(logits.dtype), mode="drop")
    return (pool, *copy_rows((key_valid, logits), copies[2], copies[3], n_copies[1]))
