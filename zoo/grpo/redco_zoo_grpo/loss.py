"""GRPO's loss, piece by piece: each sample's tokens scored by the policy, the clipped loss
of a token, the averages, the advantages, the share of tokens outside the clip range.

A training example is one sampled completion of a prompt (``rollout.py`` makes them):
``prompt_ids``/``prompt_mask`` (the prompt, left-padded), ``tokens`` (the completion, padding
after its EOS), ``completion_mask`` (its tokens up to and including the EOS: nothing after it
counts), ``old_logps`` (each token's log-probability under the policy that sampled it, as the
trainer's forward pass computes it), ``ref_logps`` (the same under the reference, where the KL
term needs it) and ``advantage`` (its reward against its group's, one number per completion).

The loss of a token is PPO's clipped surrogate with the policy ratio ``exp(logp - old_logp)``,
clipped to ``[1 - clip_low, 1 + clip_high]`` (DAPO's "clip-higher" when ``clip_high`` is the
larger), plus ``beta`` times a KL penalty to the reference. How the tokens' losses average is
the variant (``loss_type``):

* ``grpo`` (DeepSeekMath): the mean over each completion's tokens, then over completions;
  advantages divided by the group's standard deviation;
* ``dr_grpo`` (Dr. GRPO): the sum over all tokens divided by a constant (completions x
  ``max_new_tokens``), and advantages not divided by the standard deviation: neither long
  wrong answers nor easy groups are favoured;
* ``dapo`` (DAPO's token-level loss): the sum over all tokens divided by their number, so every
  token weighs the same whatever its completion's length.

The KL penalty is ``k2 = (logp - ref_logp)^2 / 2`` weighted by the (constant) ratio. Why not
DeepSeek's ``k3 = exp(ref - logp) - (ref - logp) - 1``: as a loss, k3's gradient in expectation
over the samples is the gradient of KL(reference || policy), the other direction, while k2's is
exactly that of KL(policy || reference), the penalty GRPO means; the ratio makes it so for the
later updates of a rollout too (their samples come from the policy before them). k3 stays what
the logs report as the KL's value: it is unbiased and never negative.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from redco_zoo_models.metrics import logits_and_experts

LOSS_TYPES = ("grpo", "dr_grpo", "dapo")


def token_logps_and_experts(apply_fn, params, batch: dict,
                            temperature: float) -> tuple[jax.Array, dict]:
    """``(logps, metrics)``: (B, N) each completion token's log-probability under
    ``softmax(logits / temperature)`` of the model ``params`` (the distribution the sampler
    draws from), prompt as context; and an MoE model's expert metrics (``{}`` for a dense one:
    ``redco_zoo_models.metrics.logits_and_experts``)."""
    prompt, tokens = batch["prompt_ids"], batch["tokens"]
    ids = jnp.concatenate([prompt, tokens], 1)
    segments = jnp.concatenate([batch["prompt_mask"], jnp.ones_like(tokens)], 1).astype(jnp.int32)
    logits, experts = logits_and_experts(apply_fn, params, ids[:, :-1],
                                         segment_ids=segments[:, :-1])
    logps = jax.nn.log_softmax(logits[:, prompt.shape[1] - 1:].astype(jnp.float32) / temperature)
    return jnp.take_along_axis(logps, tokens[..., None], -1)[..., 0], experts


def token_logps(apply_fn, params, batch: dict, temperature: float) -> jax.Array:
    """(B, N): ``token_logps_and_experts``'s log-probabilities alone."""
    return token_logps_and_experts(apply_fn, params, batch, temperature)[0]


def token_losses(logps: jax.Array, batch: dict, clip_low: float, clip_high: float,
                 beta: float) -> jax.Array:
    """(B, N): each token's clipped policy-ratio loss, plus ``beta`` x its k2 KL penalty
    weighted by the (constant) ratio (module docstring)."""
    ratio = jnp.exp(logps - batch["old_logps"])
    advantage = batch["advantage"][:, None]
    per_token = -jnp.minimum(ratio * advantage,
                             jnp.clip(ratio, 1 - clip_low, 1 + clip_high) * advantage)
    if beta:
        k2 = 0.5 * (logps - batch["ref_logps"]) ** 2
        per_token = per_token + beta * jax.lax.stop_gradient(ratio) * k2
    return per_token


def average(per_token: jax.Array, mask: jax.Array, loss_type: str) -> jax.Array:
    """The tokens' losses (B, N) averaged the way ``loss_type`` defines (module docstring)."""
    counted = per_token * mask
    if loss_type == "grpo":
        return jnp.mean(counted.sum(1) / jnp.maximum(mask.sum(1), 1))
    if loss_type == "dr_grpo":
        return counted.sum() / mask.size
    return counted.sum() / jnp.maximum(mask.sum(), 1)


def k3(logps, ref_logps, mask) -> float:
    """The mean over counted tokens of ``exp(ref - logp) - (ref - logp) - 1``: an unbiased,
    never negative estimate of KL(policy || reference) from the policy's samples."""
    d = np.asarray(ref_logps, np.float64) - np.asarray(logps, np.float64)
    return float(((np.exp(d) - d - 1) * mask).sum() / max(mask.sum(), 1))


def clip_fraction(logps, old_logps, mask, clip_low: float, clip_high: float) -> float:
    """The share of counted tokens (``mask``) whose ratio ``exp(logp - old_logp)`` lies outside
    ``[1 - clip_low, 1 + clip_high]``, whatever their advantage's sign (as PPO's ``clipfrac``):
    the surrogate's gradient is zero for those of them the advantage pushes further out."""
    ratio = np.exp(np.asarray(logps, np.float64) - np.asarray(old_logps, np.float64))
    outside = (ratio < 1 - clip_low) | (ratio > 1 + clip_high)
    return float((outside * mask).sum() / max(mask.sum(), 1))


def group_advantages(rewards: np.ndarray, loss_type: str) -> np.ndarray:
    """(P, G) rewards of G completions per prompt -> their advantages: reward less the group's
    mean, divided by the group's standard deviation except under ``dr_grpo``. A group whose
    completions all score the same has advantages 0: it teaches nothing."""
    centred = rewards - rewards.mean(1, keepdims=True)
    if loss_type == "dr_grpo":
        return centred
    return centred / (rewards.std(1, keepdims=True) + 1e-4)
