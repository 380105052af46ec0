"""The reference that cached generation is checked against: greedy tokens got by re-running the
whole sequence for each new token."""
import jax
import jax.numpy as jnp


def greedy_without_cache(logits_fn, prompt, n):
    """Greedy tokens, re-running the whole sequence for each (in a buffer of fixed length, so
    compiled once: a causal model's logits do not depend on the tokens after them)."""
    logits_fn, (b, p) = jax.jit(logits_fn), prompt.shape
    ids = jnp.concatenate([prompt, jnp.zeros((b, n), prompt.dtype)], 1)
    for i in range(n):
        ids = ids.at[:, p + i].set(jnp.argmax(logits_fn(ids)[:, p + i - 1], -1))
    return ids[:, p:]
