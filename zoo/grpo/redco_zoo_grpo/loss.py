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
  token weighs the same whatever its completion's length;
* ``gspo`` (Qwen's GSPO, arXiv 2507.18071): one ratio per completion, the geometric mean of its
  tokens' ratios ``s_i = exp(mean_t (logp_t - old_logp_t))``, clipped as a whole, every token of
  the completion sharing it; then averaged as ``grpo`` does, so the loss is
  ``-(1/G) sum_i min(s_i A_i, clip(s_i) A_i)``. No stop-gradient inside ``s_i``: its gradient is
  ``s_i A_i`` times the mean of the tokens' ``grad logp_t`` (zero where the clip binds). Its clip
  range is two orders of magnitude tighter than a token ratio's (the paper: 3e-4 and 4e-4), as
  a length-normalised ratio moves that much less.

A completion with no counted token (DAPO's overlong filtering: ``dapo.py``) adds 0 to the
per-completion means of ``grpo`` and ``gspo`` and nothing to ``dapo``'s count.

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
from redco_zoo_models.mrope import decode_positions

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "gspo")


def token_logps_and_experts(apply_fn, params, batch: dict,
                            temperature: float) -> tuple[jax.Array, dict]:
    """``(logps, metrics)``: (B, N) each completion token's log-probability under
    ``softmax(logits / temperature)`` of the model ``params`` (the distribution the sampler
    draws from), prompt (and its images' ``pixel_values``) as context; and an MoE model's
    expert metrics (``{}`` for a dense one: ``redco_zoo_models.metrics.logits_and_experts``)."""
    prompt, tokens = batch["prompt_ids"], batch["tokens"]
    ids = jnp.concatenate([prompt, tokens], 1)
    segments = jnp.concatenate([batch["prompt_mask"], jnp.ones_like(tokens)], 1).astype(jnp.int32)
    images = None if "image_mask" not in batch else \
        jnp.concatenate([batch["image_mask"], jnp.zeros_like(tokens, bool)], 1)[:, :-1]
    if "position_ids" in batch:  # (a Qwen-VL image prompt's: its patches, image_prompts.py)
        layout = {k.removeprefix("layout_"): v for k, v in batch.items()
                  if k.startswith("layout_")}
        logits, experts = apply_fn(params, ids[:, :-1], segments[:, :-1], batch["pixel_values"],
                                   None, mrope_positions(batch, tokens.shape[1])[:, :, :-1],
                                   layout, image_mask=images), {}
    elif "pixel_values" in batch:  # (an image prompt's: each row's images, image_prompts.py)
        logits, experts = apply_fn(params, ids[:, :-1], segments[:, :-1], batch["pixel_values"],
                                   image_mask=images), {}
    else:
        logits, experts = logits_and_experts(apply_fn, params, ids[:, :-1],
                                             segment_ids=segments[:, :-1])
    logps = jax.nn.log_softmax(logits[:, prompt.shape[1] - 1:].astype(jnp.float32) / temperature)
    return jnp.take_along_axis(logps, tokens[..., None], -1)[..., 0], experts


def mrope_positions(batch: dict, n: int) -> jax.Array:
    """(3, B, width + n): a Qwen-VL sample's M-RoPE positions, its prompt's (``position_ids``,
    from its grids) then its ``n`` completion tokens' where the engine's decode steps placed
    them: their place in the row (left padding skipped) plus the row's ``rope_delta``."""
    prompt_mask = batch["prompt_mask"]
    valid = jnp.concatenate([prompt_mask, jnp.ones((len(prompt_mask), n), bool)], 1)
    completion = decode_positions(valid, prompt_mask.shape[1], n, batch["rope_delta"])
    return jnp.concatenate([jnp.moveaxis(batch["position_ids"], 1, 0), completion], 2)


def token_logps(apply_fn, params, batch: dict, temperature: float) -> jax.Array:
    """(B, N): ``token_logps_and_experts``'s log-probabilities alone."""
    return token_logps_and_experts(apply_fn, params, batch, temperature)[0]


def sequence_log_ratios(log_ratios, mask):
    """(B,) each completion's mean log-ratio over its counted tokens (0 where none counts):
    the log of GSPO's sequence ratio ``s_i``. Works on jax and numpy arrays alike."""
    return (log_ratios * mask).sum(1) / mask.sum(1).clip(1)


def token_losses(logps: jax.Array, batch: dict, clip_low: float, clip_high: float,
                 beta: float, sequence: bool = False) -> jax.Array:
    """(B, N): each token's clipped policy-ratio loss, plus ``beta`` x its k2 KL penalty
    weighted by the (constant) token ratio (module docstring), times the batch's
    ``is_weight`` where it has one (off-policy samples' TIS weights). ``sequence``: GSPO's ratio, one
    per completion (``sequence_log_ratios`` of ``batch["completion_mask"]``), for every token."""
    ratio = jnp.exp(logps - batch["old_logps"])
    surrogate_ratio = ratio if not sequence else jnp.broadcast_to(jnp.exp(sequence_log_ratios(
        logps - batch["old_logps"], batch["completion_mask"]))[:, None], ratio.shape)
    advantage = batch["advantage"][:, None]
    per_token = -jnp.minimum(surrogate_ratio * advantage,
                             jnp.clip(surrogate_ratio, 1 - clip_low, 1 + clip_high) * advantage)
    if beta:
        k2 = 0.5 * (logps - batch["ref_logps"]) ** 2
        per_token = per_token + beta * jax.lax.stop_gradient(ratio) * k2
    if "is_weight" in batch:  # asynchronous rollouts' TIS weights (async_rollouts.py)
        per_token = per_token * batch["is_weight"]
    return per_token


def average(per_token: jax.Array, mask: jax.Array, loss_type: str) -> jax.Array:
    """The tokens' losses (B, N) averaged the way ``loss_type`` defines (module docstring)."""
    counted = per_token * mask
    if loss_type in ("grpo", "gspo"):
        return jnp.mean(counted.sum(1) / jnp.maximum(mask.sum(1), 1))
    if loss_type == "dr_grpo":
        return counted.sum() / mask.size
    return counted.sum() / jnp.maximum(mask.sum(), 1)


def k3(logps, ref_logps, mask) -> float:
    """The mean over counted tokens of ``exp(ref - logp) - (ref - logp) - 1``: an unbiased,
    never negative estimate of KL(policy || reference) from the policy's samples."""
    d = np.asarray(ref_logps, np.float64) - np.asarray(logps, np.float64)
    return float(((np.exp(d) - d - 1) * mask).sum() / max(mask.sum(), 1))


def clip_fraction(logps, old_logps, mask, clip_low: float, clip_high: float,
                  sequence: bool = False) -> float:
    """The share of counted tokens (``mask``) whose ratio ``exp(logp - old_logp)`` lies outside
    ``[1 - clip_low, 1 + clip_high]``, whatever their advantage's sign (as PPO's ``clipfrac``):
    the surrogate's gradient is zero for those of them the advantage pushes further out.
    ``sequence`` (GSPO): the share of completions with a counted token whose sequence ratio
    lies outside."""
    log_ratio = np.asarray(logps, np.float64) - np.asarray(old_logps, np.float64)
    if sequence:
        log_ratio, mask = sequence_log_ratios(log_ratio, mask), mask.any(1)
    ratio = np.exp(log_ratio)
    outside = (ratio < 1 - clip_low) | (ratio > 1 + clip_high)
    return float((outside * mask).sum() / max(mask.sum(), 1))


def group_advantages(rewards: np.ndarray, loss_type: str) -> np.ndarray:
    """(P, G) rewards of G completions per prompt -> their advantages: reward less the group's
    mean, divided by the group's standard deviation except under ``dr_grpo`` (``gspo`` and
    ``dapo`` divide, as ``grpo``). A group whose
    completions all score the same has advantages 0: it teaches nothing."""
    centred = rewards - rewards.mean(1, keepdims=True)
    if loss_type == "dr_grpo":
        return centred
    return centred / (rewards.std(1, keepdims=True) + 1e-4)
