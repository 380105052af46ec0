"""Llama 4's attention pieces, as transformers' ``Llama4TextAttention`` computes them
(``redco_zoo_models.decoder`` calls them; ``DecoderConfig`` switches them on):

* **Chunked local attention** (``chunked_layers``, Llama 4's RoPE layers): positions are cut
  into chunks of ``attention_chunk_size`` ``C`` and a query sees the earlier keys of its own
  chunk only: query position ``p`` sees key position ``q`` iff ``q <= p`` and
  ``q // C == p // C``, a block-diagonal causal mask. Positions count from a row's first real
  token (transformers offsets its chunks by the left padding too). A row holds its tokens in
  consecutive slots, so for the query in slot ``i`` at position ``p`` the key in slot ``j``
  is at ``p - (i - j)``: the query keeps slots ``j >= i - p mod C``, a window that grows
  through a chunk and starts again at the next. That holds alike in training, in a prompt and
  in a cached decode step, so one rule (``attention.within_chunk``) covers all three; without
  a mask (training) a chunk is a segment of the tiled causal attention (``attention.attend``).
* **Temperature tuning** (``attn_temperature_tuning``, the NoPE layers): each query is scaled
  by ``log(floor((s + 1) / floor_scale) + 1) * attn_scale + 1``, ``s`` its slot in the row
  (transformers counts the cache's slots, left padding included), sharpening attention far
  into a long context (arXiv 2501.19399). In packed rows too a query's slot is its place in
  the row, as transformers counts it with restarting ``position_ids``.
* **L2 q/k norm** (``qk_norm="l2"``, RoPE layers only): queries and keys divided by their
  root mean square over each head, without weights, after RoPE.

A chunked layer's cache keeps every slot (a ring of ``C`` would do). Not supported yet,
refused before compiling: context parallelism (a split sequence).
"""
from __future__ import annotations

import jax.numpy as jnp

from redco import sequence_split
from redco_zoo_models.attention import query_slots
from redco_zoo_models.layers import rms_normalized


def temperature_scaled(q, first_slot, floor_scale: float, attn_scale: float):
    """Queries ``q`` (B, T, H, D) in slots ``first_slot ...`` scaled by their temperature."""
    slots = query_slots(first_slot, q.shape[1]).astype(jnp.float32)
    scale = jnp.log1p(jnp.floor((slots + 1.0) / floor_scale)) * attn_scale + 1.0
    return (q.astype(jnp.float32) * scale[:, :, None, None]).astype(q.dtype)


def l2_normed(x, eps: float):
    """``x / rms(x)`` over the last axis (each head), in float32, without weights."""
    return rms_normalized(x.astype(jnp.float32), eps).astype(x.dtype)


def refuse_split(cfg) -> None:
    """Refuse context parallelism for chunked attention or temperature tuning, whose masks and
    scales count slots the split sequence reorders."""
    if (cfg.chunked_layers or cfg.attn_temperature_tuning) and \
            sequence_split.current() is not None:
        raise ValueError(f"{cfg.family}: chunked attention and attention temperature tuning "
                         "(Llama 4) do not support context parallelism yet: run with "
                         "n_context_shards=1.")
