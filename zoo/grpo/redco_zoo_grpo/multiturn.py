"""Multi-turn rollouts: the model and an environment (``environments.py``) take turns, token in,
token out.

Each turn samples a continuation of the prompt plus the trajectory so far, as token ids: never
the trajectory's text re-tokenised (a model that sampled ``3``, ``+``, ``4`` is trained on those
three ids even where the tokenizer would merge their text into one). The turn keeps its sampled
ids up to the first that completes the environment's ``stop`` string in their decoded text (a
tool call's end tag), or up to and including the end of turn (EOS), whichever comes first; the
environment reads the turn's decoded text and answers with an observation, which is tokenised
once, on its own, and appended after the kept ids. An episode ends when the environment says
so, after ``max_turns`` model turns, or when the trajectory fills ``max_new_tokens``.

A sample then carries ``tokens``: every id after the prompt (the model's and the
environment's, padding after them); ``completion_mask``: 1 exactly on the model's ids, so the
loss (``loss.py``, unchanged) counts those alone while the environment's ids are context; its
reward: the environment's rewards, summed. Every turn samples all rows (those whose episode
ended are sampled and ignored), so the sampler compiles once: contexts are left-padded to the
prompt's width plus ``max_new_tokens``. The sampler stops a row at its EOS only, so a turn's ids
after the stop string are drawn and dropped (the log-probabilities of those kept do not depend
on them); stopping the sampler there, and turns on the engine, are not done yet.
"""
from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable

import numpy as np

from redco.protocols import Environment, UsageError
from redco_zoo_grpo.rollout import GRPO, left_pad

MAX_TURNS = 16  # a turn's sampling rng folds in round x MAX_TURNS + turn


def turn_length(tokenizer, ids: np.ndarray, eos_id: int, stop: str) -> int:
    """How many of a turn's sampled ``ids`` it keeps: up to the first id that completes
    ``stop`` in their decoded text, or up to and including the first EOS."""
    ends = np.flatnonzero(ids == eos_id)
    n = int(ends[0]) + 1 if ends.size else len(ids)
    if stop and stop in tokenizer.decode(ids[:n]):
        return next(k for k in range(1, n + 1) if stop in tokenizer.decode(ids[:k]))
    return n


@dataclasses.dataclass
class Episode:
    """One trajectory: its ``env``, the ids after the prompt, their sampler's log-probabilities
    (0 on the environment's), which are the model's, the rewards' sum."""
    env: Environment
    budget: int  # max_new_tokens
    tokens: list = dataclasses.field(default_factory=list)
    logps: list = dataclasses.field(default_factory=list)
    mask: list = dataclasses.field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    done: bool = False

    def add(self, ids, logps, by_model: bool) -> None:
        ids = list(ids)[:self.budget - len(self.tokens)]
        self.tokens += ids
        self.logps += list(logps[:len(ids)]) if by_model else [0.0] * len(ids)
        self.mask += [by_model] * len(ids)

    def turn(self, tokenizer, ids, logps, eos_id: int, max_turns: int) -> None:
        """The model's turn (its sampled ``ids``), then the environment's answer."""
        n = turn_length(tokenizer, ids, eos_id, self.env.stop)
        self.add(ids[:n], logps, by_model=True)
        self.turns += 1
        observation, reward, done = self.env.step(tokenizer.decode(ids[:n],
                                                                   skip_special_tokens=True))
        self.reward += float(reward)
        self.done = (done or observation is None or self.turns >= max_turns
                     or len(self.tokens) >= self.budget)
        if not self.done:
            self.add(tokenizer.encode(observation, add_special_tokens=False), None, False)
            self.done = len(self.tokens) >= self.budget

    def arrays(self, pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(tokens, logps, mask)``, each ``budget`` long."""
        pad = self.budget - len(self.tokens)
        return (np.asarray(self.tokens + [pad_id] * pad, np.int32),
                np.asarray(self.logps + [0.0] * pad, np.float32),
                np.asarray(self.mask + [False] * pad, bool))


def check_max_turns(max_turns: int) -> None:
    """Refuse a number of turns the rollout's rng scheme (``MAX_TURNS``) does not take."""
    if not 1 <= max_turns <= MAX_TURNS:
        raise UsageError(f"--max_turns {max_turns}: give 1 to {MAX_TURNS}.")


class MultiTurnGRPO(GRPO):
    """``GRPO`` whose completions are multi-turn episodes with environments ``make_env()``
    (module docstring); samples on ``pred_fn``'s sampler (not the engine)."""

    def __init__(self, *args, make_env: Callable[[], Environment], max_turns: int, **kwargs):
        super().__init__(*args, **kwargs)
        check_max_turns(max_turns)
        self.make_env, self.max_turns = make_env, max_turns
        self.episodes: dict = {}  # the last completions' episode metrics (rollout)
        self.turn_sampler = self.trainer.get_default_predictor(partial(
            self.pred_fn, model=self.model, n_samples=1, **self.sampling))

    def rollout(self, *args, **kwargs) -> tuple[list[dict], dict]:
        """``GRPO.rollout``'s, its metrics with the last draw's mean ``turns`` an episode and
        ``environment_tokens`` a trajectory."""
        samples, metrics = super().rollout(*args, **kwargs)
        return samples, dict(metrics, **self.episodes)

    def sample_turn(self, predictor, contexts: list[np.ndarray], width: int, seed: int):
        """(M, max_new_tokens) ids and log-probabilities continuing each of ``contexts``
        (left-padded to ``width``)."""
        batch = [dict(p, round=np.int32(seed)) for p in
                 left_pad(contexts, width, self.tokenizer.pad_token_id or 0)]
        out = predictor.predict(batch, -(-len(batch) // self.trainer.deployer.dp_size),
                                self.trainer.params, desc="sample")
        return (np.concatenate([o[key].reshape(len(o[key]), -1) for o in out])
                for key in ("tokens", "logps"))

    def completions(self, predictor, prompts: list[dict], rows: list[dict], prompt_column: str,
                    round_: int, where: str) -> dict:
        """``GRPO.completions``' keys, of multi-turn episodes (module docstring)."""
        greedy = predictor is self.greedy
        g = 1 if greedy else self.config.n_samples
        episodes, starts = [], []
        width = len(prompts[0]["prompt_ids"]) + self.config.max_new_tokens
        for prompt, row in zip(prompts, rows):
            for _ in range(g):
                episodes.append(Episode(self.make_env(), self.config.max_new_tokens))
                episodes[-1].env.reset(row)
                starts.append(prompt["prompt_ids"][prompt["prompt_mask"]])
        for turn in range(self.max_turns):
            if all(e.done for e in episodes):
                break
            contexts = [np.concatenate([s, np.asarray(e.tokens, np.int32)])
                        for s, e in zip(starts, episodes)]
            tokens, logps = self.sample_turn(self.greedy if greedy else self.turn_sampler,
                                             contexts, width, round_ * MAX_TURNS + turn)
            for e, ids, lps in zip(episodes, tokens, logps):
                if not e.done:
                    e.turn(self.tokenizer, ids, lps, self.eos_id, self.max_turns)
        tokens, logps, mask = (np.stack(a) for a in zip(*(e.arrays(self.tokenizer.pad_token_id
                                                                    or 0) for e in episodes)))
        texts = [self.tokenizer.decode(e.tokens, skip_special_tokens=True) for e in episodes]
        self.episodes = {"turns": np.mean([e.turns for e in episodes]),
                         "environment_tokens": np.mean([len(e.mask) - sum(e.mask)
                                                        for e in episodes])}
        rewards = np.array([e.reward for e in episodes])
        if not np.isfinite(rewards).all():
            raise UsageError(f"The environment {self.make_env!r} gave a reward "
                             f"{rewards[~np.isfinite(rewards)][0]} in {where}: give finite ones.")
        return dict(tokens=tokens, logps=logps, mask=mask, texts=texts, rewards=rewards)
