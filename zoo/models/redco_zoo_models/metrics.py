"""What the zoo's text pipelines score: exact match and ROUGE-1/2/L F1 (whitespace tokens,
lower-cased; the scores of Lin (2004) without stemming), and the masked token loss."""
from __future__ import annotations

from collections import Counter
from typing import Any


def exact_match(predictions: list[str], references: list[str]) -> float:
    return sum(p.strip() == r.strip() for p, r in zip(predictions, references)) / len(references)


def _f1(overlap: int, n_pred: int, n_ref: int) -> float:
    return 0.0 if overlap == 0 else 2 * overlap / (n_pred + n_ref)


def _lcs(a: list, b: list) -> int:
    row = [0] * (len(b) + 1)
    for x in a:
        diagonal = 0
        for j, y in enumerate(b):
            diagonal, row[j + 1] = row[j + 1], diagonal + 1 if x == y else max(row[j + 1], row[j])
    return row[-1]


def rouge(predictions: list[str], references: list[str]) -> dict[str, float]:
    """Mean ``rouge1``, ``rouge2`` and ``rougeL`` F1 over the pairs."""
    totals = Counter()
    for prediction, reference in zip(predictions, references):
        p, r = prediction.lower().split(), reference.lower().split()
        for n in (1, 2):
            grams = lambda words: Counter(zip(*(words[i:] for i in range(n))))
            overlap = sum((grams(p) & grams(r)).values())
            totals[f"rouge{n}"] += _f1(overlap, max(len(p) - n + 1, 0), max(len(r) - n + 1, 0))
        totals["rougeL"] += _f1(_lcs(p, r), len(p), len(r))
    return {k: v / len(references) for k, v in totals.items()}


def text_scores(predictions: list[str], references: list[str]) -> dict[str, float]:
    """``exact_match``, ``rouge1``, ``rouge2`` and ``rougeL``."""
    return {"exact_match": exact_match(predictions, references), **rouge(predictions, references)}


def logits_and_experts(apply_fn, params, *args, **kwargs) -> tuple[Any, dict]:
    """``(apply_fn(params, ...), metrics)``: the model's metrics (an MoE's experts) where its apply
    function has them (``split_model`` of a zoo model: ``return_metrics``), else ``{}``; any
    other apply function is called as it is."""
    if getattr(apply_fn, "returns_metrics", False):
        return apply_fn(params, *args, return_metrics=True, **kwargs)
    return apply_fn(params, *args, **kwargs), {}


def with_experts(loss, metrics: dict):
    """A loss from logits (``logits_and_experts``) with an MoE model's balancing losses added,
    and its expert metrics to log: ``(loss, metrics)``; a dense model's loss as it is."""
    if not metrics:
        return loss
    return loss + metrics["moe/aux_loss"].astype(loss.dtype), metrics


def token_cross_entropy(logits, labels, mask):
    """Mean cross-entropy of the ``labels`` where ``mask`` is true (a loss, jittable)."""
    import jax.numpy as jnp
    import optax
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1)
