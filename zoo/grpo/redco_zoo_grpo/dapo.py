"""DAPO's rollout-side pieces (arXiv 2503.14476), each an option of a GRPO run (``GRPOConfig``),
all on by default under ``loss_type="dapo"``:

* dynamic sampling: a group whose G rewards are all equal (every completion right, or every one
  wrong) has advantages 0 and teaches nothing, so it is dropped and the next prompts are drawn,
  ``prompts_per_round`` at a time, until the round holds ``prompts_per_round`` groups with
  signal, or ``max_sampling_draws`` draws are spent; then the round is filled up with the
  dropped groups, in the order drawn (advantages 0: a smaller update rather than a round
  smaller than its minibatches). ``signal_groups`` and ``select_groups`` decide which.
* overlong filtering: a completion cut at ``max_new_tokens`` before its EOS is masked out of the
  loss, as its reward judges an unfinished answer (``filter_overlong``).
* the soft overlong punishment: added to the reward, 0 up to ``L_max - L_cache`` tokens, then
  falling linearly to -1 at ``L_max`` (``max_new_tokens``; ``L_cache`` is
  ``overlong_buffer``): ``soft_overlong_penalty``. Off unless a buffer is given.

``PromptStream`` hands out the prompts in a seeded order, epoch after epoch, from a position a
checkpoint keeps, so a resumed run draws the same extra prompts the uninterrupted one drew.
"""
from __future__ import annotations

import numpy as np


def filter_overlong(mask: np.ndarray, tokens: np.ndarray, eos_id: int) -> np.ndarray:
    """(M, N) ``mask`` with the rows of completions without an EOS (cut at max_new_tokens)
    cleared."""
    return mask & (tokens == eos_id).any(1, keepdims=True)


def soft_overlong_penalty(lengths: np.ndarray, max_len: int, buffer: int) -> np.ndarray:
    """DAPO's length penalty of completions ``lengths`` tokens long: 0 up to
    ``max_len - buffer``, then ``(max_len - buffer - length) / buffer`` down to -1 at
    ``max_len`` (and -1 beyond)."""
    over = np.asarray(lengths, np.float64) - (max_len - buffer)
    return -np.clip(over / buffer, 0.0, 1.0)


def signal_groups(rewards: np.ndarray) -> np.ndarray:
    """(P,) for (P, G) rewards: True where a group's rewards are not all equal."""
    return rewards.max(1) > rewards.min(1)


def select_groups(signal: np.ndarray, wanted: int) -> np.ndarray:
    """The indices, in order, of the first ``wanted`` groups with signal among those drawn;
    where too few have it, the first groups without it fill the rest (module docstring)."""
    with_signal, without = np.flatnonzero(signal), np.flatnonzero(~signal)
    fill = without[:max(wanted - len(with_signal), 0)]
    return np.sort(np.concatenate([with_signal[:wanted], fill]))


class PromptStream:
    """Prompt indices ``0..n-1`` in a permutation seeded by ``[seed, epoch]``, epoch after
    epoch; ``take()`` hands out the next ``per_take`` from ``position`` (kept by checkpoints)."""

    def __init__(self, n: int, seed: int, per_take: int, position: int = 0):
        self.n, self.seed, self.per_take, self.position = n, seed, per_take, position
        self._epochs: dict[int, np.ndarray] = {}

    def _epoch(self, epoch: int) -> np.ndarray:
        if epoch not in self._epochs:
            self._epochs[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n)
        return self._epochs[epoch]

    def take(self) -> list[int]:
        picked = [int(self._epoch(i // self.n)[i % self.n])
                  for i in range(self.position, self.position + self.per_take)]
        self.position += self.per_take
        return picked
