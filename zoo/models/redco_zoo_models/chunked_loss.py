"""Next-token cross-entropy computed a chunk of tokens at a time: the (tokens x vocabulary)
logits never exist whole.

A causal LM's output head turns each token's hidden state (width D) into V logits. For a long
sequence and a large vocabulary (Llama-3: 128,256 words) those logits, their fp32 copy for the
softmax and their gradient outweigh the rest of the step: 32k tokens per device hold 42 GB.
Here a scan takes ``chunk`` tokens at a time: their logits, log-sum-exp and the label's logit
give their losses, and the chunk is checkpointed, so the backward pass recomputes its logits
rather than keep them. Only (chunk x V) logits are alive at once.

With the sequence split over devices (``redco.sequence_split``), the hidden states arrive in
order and split along the sequence; the chunks are cut within each device's part, so every
device works on its own tokens.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from redco import sequence_split

CHUNK = 1024  # tokens per chunk (per device, under context parallelism)


def _parts(x, k: int, chunk: int):
    """(B, T, ...) -> (n, B, k, chunk, ...): each of the k devices' T/k tokens cut into n
    chunks (the last padded with zeros)."""
    b, t = x.shape[:2]
    x = x.reshape(b, k, t // k, *x.shape[2:])
    n = -(-(t // k) // chunk)
    pad = n * chunk - t // k
    x = jnp.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3))
    return jnp.moveaxis(x.reshape(b, k, n, chunk, *x.shape[3:]), 2, 0)


def next_token_loss(hidden, head, labels, mask=None, chunk: int = CHUNK,
                    softcap: float | None = None):
    """Mean cross-entropy of ``labels`` (B, T) under ``softmax(hidden @ head)`` (``hidden``
    (B, T, D), ``head`` (D, V)), over the tokens where ``mask`` (B, T) is true (all: None),
    ``chunk`` tokens at a time; ``softcap``: logits capped to ``softcap * tanh(x / softcap)``
    first (Gemma 2)."""
    if labels.shape != hidden.shape[:2] or (mask is not None and mask.shape != labels.shape):
        raise ValueError(f"labels {labels.shape} (and label_mask, if given) must be shaped like the "
                         f"input ids {hidden.shape[:2]}: one next token per input token, e.g. "
                         "model(ids[:, :-1], labels=ids[:, 1:]).")
    split = sequence_split.current()
    k = 1 if split is None else split[0].shape[split[1]]
    mask = jnp.ones(labels.shape, bool) if mask is None else mask.astype(bool)
    chunk = min(chunk, labels.shape[1] // k)  # (no chunk longer than a device's part)
    parts = [_parts(x, k, chunk) for x in (hidden, labels, mask)]
    if split is not None:  # (n, B, k, chunk, ...): device i holds part i of every chunk
        mesh, axis, _ = split
        spec = lambda x: NamedSharding(mesh, P(P.UNCONSTRAINED, P.UNCONSTRAINED, axis,
                                               *[P.UNCONSTRAINED] * (x.ndim - 3)))
        parts = [jax.lax.with_sharding_constraint(x, spec(x)) for x in parts]

    @jax.checkpoint
    def chunk_loss(h, y, m):
        logits = jnp.einsum("bkcd,dv->bkcv", h, head.astype(h.dtype),
                            preferred_element_type=jnp.float32)
        if softcap is not None:
            logits = softcap * jnp.tanh(logits / softcap)
        label_logit = jnp.take_along_axis(logits, y[..., None], axis=-1)[..., 0]
        return jnp.sum((jax.nn.logsumexp(logits, axis=-1) - label_logit) * m)

    def step(total, part):
        return total + chunk_loss(*part), None

    total, _ = jax.lax.scan(step, jnp.zeros((), jnp.float32), parts)
    return total / jnp.maximum(mask.sum(), 1)
