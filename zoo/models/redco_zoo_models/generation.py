"""Text generation with a key/value cache: greedy, sampling (temperature, top-k, top-p) and beam
search (``redco_zoo_models.beam_search``). One ``lax.scan`` over the new tokens: call it inside
a jitted function (a ``pred_fn`` under ``Predictor``) and it runs on sharded params like any
other computation.

A model generates through two methods:

* ``model.init_cache(batch, n_slots, dtype)``: an empty cache (``redco_zoo_models.attention``);
* ``model.decode(ids, key_valid, cache, cache_index, context) -> (logits, cache)``: run ``ids``
  (B, T) in the slots from ``cache_index`` on; ``key_valid`` (B, S) marks real tokens.

Encoder-decoder models also have ``model.encode(**encoder_inputs) -> context``, run once.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from redco_zoo_models.beam_search import beam_search
from redco_zoo_models.context_parallel import cache_slots


def cut_logits(logits, temperature=1.0, top_k=0, top_p=1.0):
    """``logits`` (B, V) in float32, divided by ``temperature``, with the tokens outside the
    ``top_k`` most likely (0: no cut) and then outside the fewest most likely whose
    probabilities reach ``top_p`` (1.0: no cut) at ``-inf``. Each of ``temperature`` (> 0),
    ``top_k`` and ``top_p`` is a number or a (B, 1) array, one per row (``redco_zoo_models.engine``
    samples each request with its own)."""
    logits = logits.astype(jnp.float32) / temperature
    ranked = jnp.sort(logits, -1)[:, ::-1]
    kth = jnp.take_along_axis(ranked, jnp.broadcast_to(jnp.maximum(jnp.asarray(top_k) - 1, 0),
                                                       (len(ranked), 1)), -1)
    kth = jnp.where(jnp.asarray(top_k) > 0, kth, -jnp.inf)
    logits, ranked = (jnp.where(x < kth, -jnp.inf, x) for x in (logits, ranked))
    probs = jax.nn.softmax(ranked, -1)
    keep = (jnp.cumsum(probs, -1) - probs < top_p) | (jnp.asarray(top_p) >= 1.0)
    cutoff = jnp.min(jnp.where(keep, ranked, jnp.inf), -1, keepdims=True)
    return jnp.where(logits < cutoff, -jnp.inf, logits)


def pick_tokens(logits, rng, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0):
    """Greedy (``temperature == 0``) or sampled next tokens from ``logits`` (B, V)."""
    if temperature == 0:
        return jnp.argmax(logits, -1)
    if top_k or top_p < 1.0:
        logits = cut_logits(logits, temperature, top_k, top_p)
    else:
        logits = logits.astype(jnp.float32) / temperature
    return jax.random.categorical(rng, logits)


def pick_rows(logits, keys, temperature, top_k, top_p):
    """Each row's next token from ``logits`` (B, V), with its own ``temperature`` (0: greedy),
    ``top_k``, ``top_p`` (each (B,)) and PRNG key (``keys`` (B, 2)). The sort that top-k and
    top-p need, and the sampling, run only when some row asks for them."""
    scaled = logits.astype(jnp.float32) / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    cut = jax.lax.cond(jnp.any((top_k > 0) | (top_p < 1.0)),
                       lambda x: cut_logits(x, 1.0, top_k[:, None], top_p[:, None]),
                       lambda x: x, scaled)
    greedy = jnp.argmax(logits, -1).astype(jnp.int32)
    sampled = jax.lax.cond(jnp.any(temperature > 0),
                           lambda x: jax.vmap(jax.random.categorical)(keys, x).astype(jnp.int32),
                           lambda x: greedy, cut)
    return jnp.where(temperature > 0, sampled, greedy)


def generate(model: nnx.Module, params: Any, prompt_ids, max_new_tokens: int, *,
             prompt_mask=None, encoder_inputs: dict | None = None, rng=None,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, num_beams: int = 1,
             eos_token_id: int | None = None, pad_token_id: int = 0,
             length_penalty: float = 1.0, cache_dtype=jnp.float32,
             return_logprobs: bool = False, num_samples: int = 1):
    """``(B, max_new_tokens)`` token ids generated after ``prompt_ids`` (B, P); after an
    ``eos_token_id``, ``pad_token_id``. With ``return_logprobs`` (not with beams), also each
    token's log-probability under the distribution it was drawn from before any top-k or top-p
    cut (``softmax(logits / temperature)``, untempered when greedy; what a training step
    computes from the same logits; 0 after EOS): ``(tokens, logprobs)``. ``num_samples`` (G,
    not with beams): G continuations of each prompt, rows ``i * G`` to ``i * G + G - 1`` of a
    ``(B * G, max_new_tokens)`` result; the prompts are read once and their cache copied.

    ``model`` gives the structure (its own weights are not used; ``params`` are). Prompts of
    different lengths are left-padded, with ``prompt_mask`` 0 on the padding. For an
    encoder-decoder model, ``prompt_ids`` are the decoder's start tokens and ``encoder_inputs``
    the keyword arguments of ``model.encode``. ``num_beams > 1`` runs beam search as
    transformers' ``generate`` does by default (scores divided by ``length ** length_penalty``,
    its ``early_stopping=False`` stop); otherwise greedy when ``temperature == 0``, else
    sampling with ``rng``.
    """
    m = nnx.merge(nnx.graphdef(model), params)
    key_valid = _key_valid(prompt_ids, prompt_mask, max_new_tokens)
    context = m.encode(**encoder_inputs) if encoder_inputs is not None else None
    if num_beams > 1:
        _check_beam_search(m, prompt_ids.shape[1], max_new_tokens, return_logprobs, num_samples)
        return beam_search(m, prompt_ids, key_valid, context, max_new_tokens, num_beams,
                           eos_token_id, pad_token_id, length_penalty, cache_dtype)
    cache = m.init_cache(len(prompt_ids), key_valid.shape[1], cache_dtype)
    logits, cache = m.decode(prompt_ids, key_valid, cache, 0, context)
    if num_samples > 1:  # each prompt's cache and logits copied per sample
        logits, key_valid, cache, context, prompt_ids = jax.tree.map(
            lambda x: jnp.repeat(x, num_samples, axis=0),
            (logits, key_valid, cache, context, prompt_ids))
    pick = _token_picker(rng, temperature, top_k, top_p, eos_token_id, pad_token_id,
                         prompt_ids.dtype)
    tokens, logprobs = _new_tokens(m, pick, logits, cache, key_valid, context, prompt_ids,
                                   max_new_tokens, cache_dtype)
    return (tokens, logprobs) if return_logprobs else tokens


def _key_valid(prompt_ids, prompt_mask, n_new: int):
    """(B, S): the cache's slots that hold real tokens, the prompt's (``prompt_mask``, None: all)
    and the new ones; ``S = cache_slots(P + n_new)`` (any slots past the last: never valid)."""
    b, p = prompt_ids.shape
    if prompt_mask is None:
        prompt_mask = jnp.ones((b, p), bool)
    n_slots = cache_slots(p + n_new)
    return jnp.concatenate([prompt_mask > 0, jnp.ones((b, n_new), bool),
                            jnp.zeros((b, n_slots - p - n_new), bool)], 1)


def _check_beam_search(m, n_prompt: int, n_new: int, return_logprobs: bool,
                       num_samples: int) -> None:
    """Refuse what beam search does not do: read the sequence again (``_reread_step``), give
    log-probabilities or several samples per prompt."""
    if _reread_step(m, n_prompt, n_new) is not None:
        raise ValueError(f"Beam search across slot {m.rereads_at()}, where this model's "
                         "RoPE factors switch and the sequence is read again, is not "
                         "supported: sample instead, or keep the prompt and the new tokens "
                         "on one side of it.")
    if return_logprobs or num_samples > 1:
        raise ValueError("Beam search returns one sequence per prompt and no "
                         "log-probabilities: use num_beams=1 with num_samples or "
                         "return_logprobs.")


def _token_picker(rng, temperature: float, top_k: int, top_p: float, eos: int | None,
                  pad: int, dtype):
    """``pick(logits, finished, i) -> (token, logprob, finished)``: step ``i``'s tokens
    (``pad`` where finished; an ``eos`` finishes) and their log-probabilities before any top-k
    or top-p cut (0 where finished)."""
    rng = jax.random.PRNGKey(0) if rng is None else rng
    scale = temperature if temperature > 0 else 1.0

    def pick(logits, finished, i):
        token = pick_tokens(logits, jax.random.fold_in(rng, i), temperature, top_k, top_p)
        token = jnp.where(finished, pad, token).astype(dtype)
        logprob = jnp.where(finished, 0.0, jnp.take_along_axis(
            jax.nn.log_softmax(logits.astype(jnp.float32) / scale), token[:, None], -1)[:, 0])
        if eos is not None:
            finished = finished | (token == eos)
        return token, logprob, finished
    return pick


def _new_tokens(m, pick, logits, cache, key_valid, context, prompt_ids, n_new: int,
                cache_dtype):
    """``(tokens, logprobs)``, each (B, n_new), decoded after the prompt's ``logits`` and
    ``cache`` with ``pick``: one ``lax.scan``, or two around the step whose token is read again
    with the whole sequence before it (``_reread_step``)."""
    b, p = prompt_ids.shape

    def step(carry, i):
        logits, cache, finished = carry
        token, logprob, finished = pick(logits, finished, i)
        logits, cache = m.decode(token[:, None], key_valid, cache, p + i, context)
        return (logits[:, -1], cache, finished), (token, logprob)

    carry = (logits[:, -1], cache, jnp.zeros((b,), bool))
    reread = _reread_step(m, p, n_new)
    if reread is None:
        _, (tokens, logprobs) = jax.lax.scan(step, carry, jnp.arange(n_new))
        return tokens.T, logprobs.T
    # the token fed at slot `reread` is fed with all before it, into an empty cache
    carry, (before, before_lp) = jax.lax.scan(step, carry, jnp.arange(reread))
    logits, _, finished = carry
    token, logprob, finished = pick(logits, finished, reread)
    ids = jnp.concatenate([prompt_ids, before.T.astype(prompt_ids.dtype), token[:, None]], 1)
    cache = m.init_cache(b, key_valid.shape[1], cache_dtype)
    logits, cache = m.decode(ids, key_valid, cache, 0, context)
    _, (after, after_lp) = jax.lax.scan(step, (logits[:, -1], cache, finished),
                                        jnp.arange(reread + 1, n_new))
    return (jnp.concatenate([before.T, token[:, None], after.T], 1),
            jnp.concatenate([before_lp.T, logprob[:, None], after_lp.T], 1))


def _reread_step(m, n_prompt: int, n_new: int) -> int | None:
    """The generation step whose token is read together with the whole sequence before it, into
    a new cache (``model.rereads_at()``: a RoPE whose factors switch with the length), if one of
    this generation's steps feeds that slot."""
    at = getattr(m, "rereads_at", lambda: None)()
    return at - n_prompt if at is not None and 0 <= at - n_prompt < n_new else None
