"""What the zoo's text pipelines score: exact match and ROUGE-1/2/L F1 (whitespace tokens,
lower-cased; the scores of Lin (2004) without stemming), and the masked token loss."""
from __future__ import annotations

from collections import Counter


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


def token_cross_entropy(logits, labels, mask):
    """Mean cross-entropy of the ``labels`` where ``mask`` is true (a loss, jittable)."""
    import jax.numpy as jnp
    import optax
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1)
