"""Each token's log-probability given the tokens before it, and the most likely alternatives at
each place: one forward pass over the whole sequence (what an evaluation harness asks of a
server to score a multiple-choice answer: the prompt's own log-probabilities).

The sequence is right-padded to a power of two (few shapes compile); a decoder is causal, so
the padding changes nothing before it. Positions from ``tempered_from`` on are scored under
``softmax(logits / temperature)``, as the engine reports a sampled token's log-probability;
those before it (a prompt) under the plain softmax.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

MAX_ALTERNATIVES = 20  # the most alternatives a place reports (vLLM's bound; OpenAI's is 5)


@dataclasses.dataclass
class Scores:
    """For places 1 to n-1 of a sequence of n tokens: the token's log-probability, and the
    ``k`` likeliest tokens there with theirs (most likely first)."""
    logprobs: np.ndarray  # (n-1,)
    top_ids: np.ndarray  # (n-1, k)
    top_logprobs: np.ndarray  # (n-1, k)


def _score(graphdef, params, ids, length, tempered_from, temperature):
    model = nnx.merge(graphdef, params)
    valid = jnp.arange(ids.shape[1])[None] < length
    logits = model(ids, attention_mask=valid)[0, :-1].astype(jnp.float32)
    tempered = jnp.arange(logits.shape[0])[:, None] + 1 >= tempered_from
    logits = jnp.where(tempered, logits / temperature, logits)
    logprobs = jax.nn.log_softmax(logits)
    own = jnp.take_along_axis(logprobs, ids[0, 1:, None], 1)[:, 0]
    top_logprobs, top_ids = jax.lax.top_k(logprobs, min(MAX_ALTERNATIVES, logprobs.shape[-1]))
    return own, top_ids, top_logprobs


class Scorer:
    """``scorer(tokens, k)``: the ``Scores`` of ``tokens`` under ``model`` with ``params``
    (placed as they are, on one device or sharded)."""

    def __init__(self, model: nnx.Module, params: Any, max_len: int):
        self.params, self.max_len = params, max_len
        self._score = jax.jit(functools.partial(_score, nnx.graphdef(model)))

    def __call__(self, tokens: list[int], k: int = 0, tempered_from: int | None = None,
                 temperature: float = 1.0) -> Scores:
        if not 2 <= len(tokens) <= self.max_len:
            raise ValueError(f"Scoring takes 2 to {self.max_len} tokens; got {len(tokens)}.")
        width = min(max(16, 1 << (len(tokens) - 1).bit_length()), self.max_len)
        ids = np.zeros((1, width), np.int32)
        ids[0, :len(tokens)] = tokens
        start = len(tokens) if tempered_from is None else tempered_from
        own, top_ids, top_lps = self._score(self.params, ids, len(tokens), start,
                                            temperature if temperature > 0 else 1.0)
        n = len(tokens) - 1
        return Scores(np.asarray(own)[:n], np.asarray(top_ids)[:n, :k],
                      np.asarray(top_lps)[:n, :k])
