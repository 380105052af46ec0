"""The log-probabilities a reply carries: each returned token's own (the engine's, as it
sampled it) and, when asked, the ``k`` likeliest alternatives at each place and the prompt's
tokens too (``echo``), from one forward pass over prompt and completion
(``redco_zoo_models.scoring``): what evaluation harnesses read to score a multiple-choice
answer. The prompt's first token has none (nothing comes before it)."""
from __future__ import annotations

import dataclasses

from redco_zoo_models.scoring import Scorer


@dataclasses.dataclass
class TokenLogprobs:
    """One choice's tokens as text pieces, their log-probabilities (None: the first prompt
    token) and, when asked, each place's alternatives (piece -> log-probability)."""
    pieces: list[str]
    logprobs: list[float | None]
    alternatives: list[dict[str, float] | None] | None


def token_logprobs(tokenizer, scorer: Scorer, prompt: list[int], sample, k: int | None,
                   echo: bool, temperature: float) -> TokenLogprobs:
    """``sample``'s (and with ``echo`` the ``prompt``'s) tokens with their log-probabilities;
    ``k`` alternatives a place when ``k`` is above 0."""
    tokens = list(sample.tokens)
    shown = prompt + tokens if echo else tokens
    pieces = [tokenizer.decode([t]) for t in shown]
    scores = None
    if echo or k:
        scores = scorer(prompt + tokens, k or 0, tempered_from=len(prompt),
                        temperature=temperature)
    logprobs = list(sample.logprobs[:len(tokens)])
    if echo:
        logprobs = [None, *map(float, scores.logprobs[:len(prompt) - 1]), *logprobs]
    if not k:
        return TokenLogprobs(pieces, logprobs, None)
    first = 0 if echo else len(prompt) - 1  # scores[i]: the place of token i + 1
    alternatives = [{tokenizer.decode([int(t)]): float(lp) for t, lp in zip(ids, lps)}
                    for ids, lps in zip(scores.top_ids[first:], scores.top_logprobs[first:])]
    return TokenLogprobs(pieces, logprobs, [None] * echo + alternatives)
