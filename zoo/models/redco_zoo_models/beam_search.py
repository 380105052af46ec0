"""Beam search over a model's key/value cache, as transformers' PyTorch ``generate`` runs it by
default (``early_stopping=False``): ``redco_zoo_models.generation.generate`` with
``num_beams > 1`` calls ``beam_search`` (the model's ``init_cache`` and ``decode`` as there).

The state (``_Beams``) holds, per example, its ``k`` live beams and its finished hypotheses with
their scores; one ``lax.scan`` step ranks the live beams' ``2k`` best continuations, reorders
the cache by the beams they came from, and decodes the new tokens.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class _Beams(NamedTuple):
    """Beam search's state: per example, its ``k`` live beams (``alive`` (B, k, n_new)) and
    finished hypotheses (``done``), their scores, and whether it still takes more (``open_``)."""
    alive: Any
    alive_scores: Any
    done: Any
    done_scores: Any
    open_: Any


def beam_search(m, prompt_ids, key_valid, context, n_new: int, k: int, eos: int | None,
                pad: int, length_penalty: float, cache_dtype):
    """Beam search as transformers' PyTorch ``generate`` runs it by default
    (``early_stopping=False``). Each step ranks the ``2k`` best continuations: those among the
    best ``k`` that end in EOS become finished hypotheses, scored ``sum of log-probabilities /
    length ** length_penalty`` (the length counts the EOS); the best ``k`` that do not end live
    on. An example keeps at most ``k`` finished ones and stops taking more once they all beat its
    best live beam's score normalised by its current length (transformers' heuristic). At the
    end the live beams count as finished at full length."""
    b, p = prompt_ids.shape
    per_beam = lambda x: jnp.repeat(x, k, axis=0)  # (B, ...) -> (B * k, ...)
    key_valid, context = per_beam(key_valid), jax.tree.map(per_beam, context)
    cache = m.init_cache(b * k, key_valid.shape[1], cache_dtype)
    logits, cache = m.decode(per_beam(prompt_ids), key_valid, cache, 0, context)

    def step(carry, i):
        logits, cache, beams = carry
        beams, source = _extend_beams(beams, logits, i, eos, length_penalty)
        rows = (jnp.arange(b)[:, None] * k + source).reshape(-1)
        cache = jax.tree.map(lambda c: c[rows], cache)
        logits, cache = m.decode(beams.alive[:, :, i].reshape(-1, 1), key_valid, cache, p + i,
                                 context)
        return (logits[:, -1], cache, beams), None

    start = _start_beams(b, k, n_new, pad, prompt_ids.dtype)
    (_, _, beams), _ = jax.lax.scan(step, (logits[:, -1], cache, start), jnp.arange(n_new))
    return _best_sequences(beams, n_new, length_penalty)


def _start_beams(b: int, k: int, n_new: int, pad: int, dtype) -> _Beams:
    """Before the first step: one live beam per example (the others at -inf), all ``pad``;
    nothing finished; every example open."""
    alive = jnp.full((b, k, n_new), pad, dtype)
    alive_scores = jnp.tile(jnp.where(jnp.arange(k) == 0, 0.0, -jnp.inf), (b, 1))  # one start
    return _Beams(alive, alive_scores, alive, jnp.full((b, k), -jnp.inf), jnp.ones((b,), bool))


def _extend_beams(beams: _Beams, logits, i, eos, length_penalty) -> tuple[_Beams, Any]:
    """Step ``i``: the beams after their ``2k`` best continuations by ``logits`` (B * k, V)
    are ranked (the best ``k`` ending in EOS finish), and each new live beam's source (B, k)."""
    alive, alive_scores, done, done_scores, open_ = beams
    b, k = alive_scores.shape
    # open_: no k finished yet (min -inf) or the best live beam, normalised by the length so
    # far, beats the worst of them; once closed, an example keeps what it has finished
    open_ = open_ & (_normed(alive_scores[:, 0], jnp.maximum(i, 1), length_penalty)
                     > done_scores.min(1))
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32)).reshape(b, k, -1)
    vocab = logprobs.shape[-1]
    scores, index = jax.lax.top_k((alive_scores[..., None] + logprobs).reshape(b, -1), 2 * k)
    source, token = index // vocab, (index % vocab).astype(alive.dtype)
    seqs = _take(alive, source).at[:, :, i].set(token)  # (B, 2k, n_new)
    ends = token == eos if eos is not None else jnp.zeros_like(token, bool)
    kept = ends & (jnp.arange(2 * k) < k) & open_[:, None]  # only the best k may finish
    finished = jnp.where(kept, _normed(scores, i + 1, length_penalty), -jnp.inf)
    done_scores, best = jax.lax.top_k(jnp.concatenate([done_scores, finished], 1), k)
    done = _take(jnp.concatenate([done, seqs], 1), best)
    alive_scores, best = jax.lax.top_k(jnp.where(ends, -jnp.inf, scores), k)
    alive, source = _take(seqs, best), _take(source, best)
    return _Beams(alive, alive_scores, done, done_scores, open_), source


def _best_sequences(beams: _Beams, n_new: int, length_penalty: float):
    """Each example's best finished hypothesis (B, n_new), its live beams counting as finished
    at full length while it is open."""
    last = jnp.where(beams.open_[:, None], _normed(beams.alive_scores, n_new, length_penalty),
                     -jnp.inf)
    scores = jnp.concatenate([beams.done_scores, last], 1)
    return _take(jnp.concatenate([beams.done, beams.alive], 1), jnp.argmax(scores, 1)[:, None])[:, 0]


def _normed(scores, length, length_penalty: float):
    """``scores`` of sequences of ``length`` tokens divided by ``length ** length_penalty``."""
    return scores / jnp.asarray(length, jnp.float32) ** length_penalty


def _take(x, index):
    """``x`` (B, n, ...) at ``index`` (B, m) along axis 1."""
    return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), 1)
