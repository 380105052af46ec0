"""GRPO's loop. Each round takes the next prompts (a seeded shuffle, epoch after epoch) and:

1. samples G completions of each on the params as they train: on the continuous-batching
   engine (``engine_rollouts.py``: the trainer's own params moved onto a decode layout and
   back, no second copy; each prompt's samples sharing its prefill, finished rows refilled at
   once), or with ``engine_rows=0`` by ``pred_fn`` (the
   zoo's fixed-batch sampler, G samples per prompt in one call, run by a ``Predictor`` on the
   training layout); or, with ``rollout_devices``, on devices of their own, dispatched up to
   ``max_off_policy_steps`` rounds ahead of the updates (``async_rollouts.py``: each sample then
   carries its policy version, its rollout log-probs and its TIS weight);
2. scores them with the reward function (``rewards.py``; checked: one finite number each),
   DAPO's soft overlong punishment added where asked; under DAPO's dynamic sampling, draws the
   next prompts while too few groups have signal, and keeps a round's worth (``dapo.py``);
3. turns each group's rewards into advantages (``loss.group_advantages``), DAPO's overlong
   filtering masking the cut completions out of the loss;
4. runs the trainer's forward pass over them once (``score_fn``): the ``old_logps`` the ratio
   divides by, and the reference's ``ref_logps`` for the KL term. So the first update's ratio is
   exactly 1 whatever the sampler's numerics; the largest gap between the two log-probabilities
   of the same tokens is logged each round (``rollout/logprob_gap``);
5. trains ``n_updates`` (mu) epochs of minibatches over those samples, all in one compiled call
   (``Trainer.train_scanned``);
6. scores the same samples once more with the updated policy (one forward pass, ``score_fn``
   without the reference: without a reference model, the very program of step 4, not compiled
   again) for ``rollout/clip_fraction``: the share of counted completion tokens
   whose ratio to ``old_logps`` lies outside ``[1 - clip_low, 1 + clip_high]``
   (``loss.clip_fraction``). Measured after the round's updates: 0 means they left every
   token's ratio inside the range, a large share that they moved the policy past it.

The reference: with LoRA adapters, the same params with the adapters zeroed (no copy); without
them and with ``beta > 0``, a copy of the params made before the first update.
"""
from __future__ import annotations

import json
import os
import time
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from redco import Trainer
from redco.lora import trainable_mask, without_adapters
from redco_zoo_grpo.async_rollouts import (
    AsyncConfig,
    AsyncRollouts,
    rollout_devices,
    timeline_path,
)
from redco_zoo_grpo.config import GRPOConfig
from redco_zoo_grpo.dapo import (
    PromptStream,
    filter_overlong,
    select_groups,
    signal_groups,
    soft_overlong_penalty,
)
from redco_zoo_grpo.engine_rollouts import EngineRollouts, image_slots
from redco_zoo_grpo.loss import clip_fraction, group_advantages, k3, token_logps
from redco_zoo_grpo.rewards import score
from redco_zoo_models import split_model
from redco_zoo_sft.chat import stop_token_id


def score_fn(rng, params, batch, apply_fn, temperature: float, reference: str | None):
    """The trainer's log-probabilities of the sampled tokens: the policy's (``old_logps``) and,
    for the KL term, the reference's (``ref_logps``)."""
    out = {"old_logps": token_logps(apply_fn, params["policy"], batch, temperature)}
    if reference is not None:
        ref = without_adapters(params["policy"]) if reference == "adapters off" else \
            params["reference"]
        out["ref_logps"] = token_logps(apply_fn, ref, batch, temperature)
    return out


# what is added to a sample once scored (score_fn's, then asynchronous rollouts')
SCORED = ("old_logps", "ref_logps", "rollout_logps", "is_weight", "policy_version")
DRAW_STRIDE = 1 << 20  # a round's draw d samples on the rng stream of "round" round + d x this


def completion_mask(tokens: np.ndarray, eos_id: int) -> np.ndarray:
    """(M, N) True on each completion's tokens up to and including its first EOS."""
    return np.cumsum(tokens == eos_id, 1) - (tokens == eos_id) == 0


def left_pad(prompts: list[np.ndarray], width: int, pad_id: int) -> list[dict]:
    """Prompt token ids -> ``{"prompt_ids", "prompt_mask"}`` left-padded to ``width``."""
    out = []
    for ids in prompts:
        padded = np.full(width, pad_id, np.int32)
        padded[width - len(ids):] = ids
        out.append({"prompt_ids": padded, "prompt_mask": np.arange(width) >= width - len(ids)})
    return out


class GRPO:
    """Rounds of sample -> score -> advantages -> ``n_updates`` epochs (module docstring) for
    ``trainer``, whose params ``model`` gives the structure of; ``pred_fn(rng, params, batch,
    model, n_samples, **sampling)`` samples (``pipeline.pred_fn``) when ``engine_rows`` is 0,
    else the engine with that many rows does, on the decode layout ``decode_model_shards``
    (``"auto"``, a tensor-parallel degree, or None: the training layout;
    ``engine_rollouts.py``), on devices of their own and ahead of the updates where
    ``asynchronous`` says (``async_rollouts.py``); ``tokenizer`` decodes and ``reward_fn``
    scores."""

    def __init__(self, trainer: Trainer, model, tokenizer, pred_fn: Callable, reward_fn: Callable,
                 config: GRPOConfig, per_device_batch_size: int, engine_rows: int = 0,
                 decode_model_shards: int | str | None = "auto",
                 asynchronous: AsyncConfig = AsyncConfig()):
        self.asynchronous = asynchronous if asynchronous.rollout_devices else None
        self.trainer, self.tokenizer, self.reward_fn, self.config = \
            trainer, tokenizer, reward_fn, config
        self.model, self.engine_rows, self.engine = model, engine_rows, None
        self.decode_model_shards = decode_model_shards
        self.batch_size = per_device_batch_size
        self.eos_id = stop_token_id(tokenizer)  # the end of the assistant's turn
        sampling = dict(config.sampling(), eos_token_id=self.eos_id,
                        pad_token_id=tokenizer.pad_token_id or 0)
        self.pred_fn, self.sampling = pred_fn, sampling
        self.sampler = trainer.get_default_predictor(partial(
            pred_fn, model=model, n_samples=config.n_samples, **sampling))
        self.greedy = trainer.get_default_predictor(partial(
            pred_fn, model=model, n_samples=1, **dict(sampling, temperature=0.0)))
        lora = any(jax.tree.leaves(trainable_mask(trainer.params)))
        self.reference = None if not config.beta else "adapters off" if lora else "copy"
        score = partial(score_fn, apply_fn=split_model(model)[0], temperature=config.temperature)
        self.scorer = trainer.get_default_predictor(partial(score, reference=self.reference))
        # the clip fraction's pass scores the policy alone: without a reference that is the
        # scorer's own program, compiled once for both
        self.rescorer = self.scorer if self.reference is None else \
            trainer.get_default_predictor(partial(score, reference=None))
        self.ref_params = None
        self.round, self.eval_rewards = 0, []  # rounds done; greedy rewards so far
        self.prompts: PromptStream | None = None  # the training prompts' order (train)
        self.shown: list[dict] = []  # the last round's first completions (write_samples)

    def completions(self, predictor, prompts: list[dict], rows: list[dict], prompt_column: str,
                    round_: int, where: str) -> dict:
        """The completions of ``prompts`` (of ``rows``), flat: ``tokens``, ``logps``, ``mask``
        (what the loss counts), ``texts`` and ``rewards`` (``where`` names them in errors)."""
        if self.engine is not None:
            tokens, logps = self.engine.sample(prompts, round_, greedy=predictor is self.greedy)
        else:
            n_devices = self.trainer.deployer.dp_size
            out = predictor.predict([dict(p, round=np.int32(round_)) for p in prompts],
                                    -(-len(prompts) // n_devices), self.trainer.params,
                                    desc="sample")
            tokens = np.concatenate([o["tokens"] for o in out])
            logps = np.concatenate([o["logps"] for o in out])
        mask = completion_mask(tokens, self.eos_id)
        texts = self.tokenizer.batch_decode(np.where(mask, tokens, self.eos_id),
                                            skip_special_tokens=True)
        return dict(tokens=tokens, logps=logps, mask=mask, texts=texts,
                    rewards=self.rewards(rows, texts, prompt_column, where))

    def rewards(self, rows: list[dict], texts: list[str], prompt_column: str,
                where: str) -> np.ndarray:
        """The reward function's rewards for ``texts``, the completions of ``rows`` (as many
        each: they are in groups)."""
        per_row = len(texts) // len(rows)
        columns = {key: [row[key] for row in rows for _ in range(per_row)] for key in rows[0]}
        return score(self.reward_fn, columns.pop(prompt_column), texts, columns, where)

    def draw(self, prompts: list[dict], rows: list[dict], prompt_column: str, round_: int,
             draw: int = 0) -> dict:
        """G completions of each of ``prompts`` (the round's ``draw``-th draw, on an rng stream
        of its own: ``DRAW_STRIDE``), their rewards, and those with DAPO's length penalty
        (``shaped``: the rewards themselves without an ``overlong_buffer``)."""
        c = self.config
        out = self.completions(self.sampler, prompts, rows, prompt_column,
                               round_ + draw * DRAW_STRIDE, f"round {round_}'s rollouts")
        if self.asynchronous:  # each sample's policy version (async_rollouts.py)
            out["versions"] = np.full(len(out["tokens"]), self.engine.current_version)
        shaped = out["rewards"]
        if c.overlong_buffer:
            shaped = shaped + soft_overlong_penalty(out["mask"].sum(1), c.max_new_tokens,
                                                    c.overlong_buffer)
        return dict(prompts=prompts, rows=rows, shaped=shaped, **out)

    def round_groups(self, prompts: list[dict], rows: list[dict], prompt_column: str,
                     round_: int, more: Callable | None = None) -> tuple[dict, dict]:
        """The round's groups (``draw``'s keys) and what to log of its rewards: the draw of
        ``prompts``; under dynamic sampling, draws of ``more()``'s prompts after it while fewer
        than ``len(prompts)`` groups have signal, and that many of them kept (``dapo.py``)."""
        g, c = self.config.n_samples, self.config
        draws = [self.draw(prompts, rows, prompt_column, round_)]
        def n_signal() -> int:
            return sum(signal_groups(d["shaped"].reshape(-1, g)).sum() for d in draws)
        while (c.dynamic_sampling and more is not None and len(draws) < c.max_sampling_draws
               and n_signal() < len(prompts)):
            draws.append(self.draw(*more(), prompt_column, round_, len(draws)))
        drawn = {k: sum((d[k] for d in draws), []) if isinstance(draws[0][k], list)
                 else np.concatenate([d[k] for d in draws]) for k in draws[0]}
        rewards = drawn["rewards"]
        metrics = {"reward": rewards.mean(), "reward_std": rewards.reshape(-1, g).std(1).mean(),
                   "reward_min": rewards.min(), "reward_max": rewards.max(),
                   "groups_without_signal": np.mean(rewards.reshape(-1, g).std(1) == 0)}
        if not c.dynamic_sampling:
            return drawn, metrics
        signal = signal_groups(drawn["shaped"].reshape(-1, g))
        keep = select_groups(signal, len(prompts))
        metrics.update(prompts_drawn=len(signal), groups_dropped=len(signal) - len(keep),
                       groups_kept_without_signal=np.sum(~signal[keep]))
        samples = (keep[:, None] * g + np.arange(g)).ravel()
        pick = lambda v, at: [v[i] for i in at] if isinstance(v, list) else v[at]  # noqa: E731
        return {k: pick(v, keep if k in ("prompts", "rows") else samples)
                for k, v in drawn.items()}, metrics

    def rollout(self, prompts: list[dict], rows: list[dict], prompt_column: str,
                round_: int, more: Callable | None = None) -> tuple[list[dict], dict]:
        """One round's training samples (``loss.py``'s examples) and what to log of them;
        ``more()``: the next prompts and their rows, for dynamic sampling (``round_groups``)."""
        g, c = self.config.n_samples, self.config
        drawn, metrics = self.round_groups(prompts, rows, prompt_column, round_, more)
        tokens, texts, rewards, mask = (drawn[k] for k in ("tokens", "texts", "rewards", "mask"))
        advantages = group_advantages(drawn["shaped"].reshape(-1, g), c.loss_type).ravel()
        counted = filter_overlong(mask, tokens, self.eos_id) if c.overlong_filter else mask
        samples = [dict(drawn["prompts"][i // g], tokens=tokens[i], completion_mask=counted[i],
                        advantage=np.float32(advantages[i])) for i in range(len(tokens))]
        params = {"policy": self.trainer.params, "reference": self.ref_params}
        for sample, logps in zip(samples, self.scorer.predict(samples, self.batch_size, params,
                                                              desc="score")):
            sample.update(logps)
        old = np.stack([s["old_logps"] for s in samples])
        metrics.update(completion_tokens=mask.sum(1).mean(),
                       cut_at_max_new_tokens=np.mean(~(tokens == self.eos_id).any(1)),
                       logprob_gap=np.abs(np.where(mask, old - drawn["logps"], 0)).max())
        if c.overlong_filter:
            metrics["masked_overlong"] = np.mean(~counted.any(1))
        if c.overlong_buffer:
            metrics["overlong_penalty"] = np.mean(drawn["shaped"] - rewards)
        self.shown = [{"round": round_, "prompt": drawn["rows"][i // g][prompt_column],
                       "completion": texts[i], "reward": float(rewards[i])}
                      for i in range(min(len(texts), 2 * g))]  # the first two prompts' groups
        if self.reference is not None:
            metrics["kl"] = k3(old, np.stack([s["ref_logps"] for s in samples]), mask)
        if self.asynchronous:
            metrics.update(self.engine.correct(samples, old, drawn["logps"], counted, round_,
                                               self.asynchronous.is_cap, drawn["versions"]))
        return samples, metrics

    def clip_fraction(self, samples: list[dict]) -> float:
        """The share of ``samples``' counted tokens whose ratio under the params as they are now
        lies outside the clip range (``loss.clip_fraction``): one forward pass."""
        params = {"policy": self.trainer.params, "reference": None}
        scored = [{k: v for k, v in s.items() if k not in SCORED} for s in samples]  # as scored
        new = np.stack([out["old_logps"] for out in  # score_fn's name: the params' as they are
                        self.rescorer.predict(scored, self.batch_size, params, desc="rescore")])
        old, mask = (np.stack([s[key] for s in samples]) for key in ("old_logps", "completion_mask"))
        return clip_fraction(new, old, mask, self.config.clip_low, self.config.clip_high,
                             sequence=self.config.loss_type == "gspo")

    def greedy_reward(self, prompts: list[dict], rows: list[dict], prompt_column: str) -> float:
        """The mean reward of the greedy completion of each prompt."""
        return float(self.completions(self.greedy, prompts, rows, prompt_column, 0,
                                      "the greedy completions")["rewards"].mean())

    def decide_layout(self, prompts: list[dict], seed: int) -> None:
        """Fix the trainer's layout (and place its params) before the first rollout samples on
        them: from the loss on placeholder samples shaped as the rollouts' will be; then the
        engine on that layout."""
        n = self.config.max_new_tokens
        placeholder = dict(prompts[0], tokens=np.zeros(n, np.int32),
                           completion_mask=np.ones(n, bool), advantage=np.float32(0),
                           old_logps=np.zeros(n, np.float32))
        if self.reference is not None:
            placeholder["ref_logps"] = placeholder["old_logps"]
        size = self.trainer.deployer.get_global_batch_size(self.batch_size)
        self.trainer.prepare([placeholder] * size, self.batch_size)
        if self.reference == "copy":  # the params before the first update
            self.ref_params = jax.tree.map(jnp.copy, self.trainer.params)
        if self.engine_rows:
            slots = image_slots(prompts[0])  # (image prompts: image_prompts.py)
            engine = (EngineRollouts, slots) if not self.asynchronous else (AsyncRollouts, dict(
                devices=rollout_devices(self.asynchronous.rollout_devices,
                                        self.trainer.deployer.devices)[1],
                max_off_policy_steps=self.asynchronous.max_off_policy_steps,
                timeline=timeline_path(self.trainer.deployer.workdir)))
            self.engine = engine[0](
                self.trainer, self.model, self.config, self.eos_id,
                self.tokenizer.pad_token_id or 0, self.engine_rows,
                len(prompts[0]["prompt_ids"]), seed, self.decode_model_shards, **engine[1])

    def state_dict(self) -> dict:
        """What a step checkpoint keeps of the loop (``trainer.run``): the rounds done, the
        greedy rewards logged so far, the prompts taken (dynamic sampling takes extra) and the
        asynchronous rollouts in flight (``async_rollouts.py``)."""
        in_flight = {"in_flight": self.engine.state_dict()} if self.asynchronous else {}
        return {"round": self.round, "eval_rewards": self.eval_rewards,
                "prompts_taken": self.prompts.position, **in_flight}

    def load_state_dict(self, state: dict) -> None:
        self.round, self.eval_rewards = state["round"], state["eval_rewards"]
        self.prompts.position = state.get("prompts_taken",  # (a checkpoint from before it)
                                          self.round * self.prompts.per_take)
        if self.asynchronous:
            self.engine.load_state_dict(state.get("in_flight", {}))

    def evaluate(self, evaluate: tuple[list[dict], list[dict]], prompt_column: str) -> None:
        """The greedy reward on ``evaluate``, logged (``eval/reward``) and kept."""
        self.eval_rewards.append(self.greedy_reward(*evaluate, prompt_column))
        self.trainer.deployer.log_metrics({"eval/reward": self.eval_rewards[-1]},
                                          self.trainer.step)
        self.trainer.deployer.log_info(f"round {self.round}: greedy reward on the held-out "
                                       f"prompts {self.eval_rewards[-1]:.3f}")

    def train(self, train: tuple[list[dict], list[dict]], evaluate: tuple[list[dict], list[dict]],
              prompt_column: str, n_rounds: int, prompts_per_round: int,
              eval_every: int = 10, seed: int = 0, **run_options) -> list[float]:
        """``n_rounds`` rounds over ``train = (prompts, rows)``; the greedy reward on
        ``evaluate`` before the first, every ``eval_every`` rounds and after the last (logged
        as ``eval/reward`` and returned). Run in ``trainer.run(**run_options)``: a rerun resumes
        from the newest step checkpoint at the round after it, a SIGTERM saves one and stops."""
        self.decide_layout(train[0], seed)
        self.round, self.eval_rewards = 0, []
        self.prompts = PromptStream(len(train[0]), seed, prompts_per_round)
        def lookup(picked: list[int]) -> tuple[list[dict], list[dict]]:
            return [train[0][i] for i in picked], [train[1][i] for i in picked]
        def take() -> tuple[list[dict], list[dict]]:  # the next round's (or draw's) prompts
            return lookup(self.prompts.take())
        with self.trainer.run(loop=self, **run_options) as run:
            if self.asynchronous:  # the params (resumed or not) onto the rollout mesh
                self.engine.publish(self.trainer.state.params, self.round)
                self.engine.feed(self.prompts.take, lambda i: lookup(i)[0], n_rounds)
            if run.resumed_from is None:
                self.evaluate(evaluate, prompt_column)  # also checks the reward function
            while self.round < n_rounds:
                picked = lookup(self.engine.ahead(self.round + 1)) if self.asynchronous \
                    else take()
                self.train_round(run, *picked, prompt_column, n_rounds, more=take)
                if self.round % eval_every == 0 or self.round == n_rounds:
                    self.evaluate(evaluate, prompt_column)
                    self.write_samples()
                run.step_done()
        return self.eval_rewards

    def train_round(self, run, prompts: list[dict], rows: list[dict], prompt_column: str,
                    n_rounds: int, more: Callable | None = None) -> None:
        """The next round: its rollouts (timed as ``rollout`` in ``goodput.json``), then
        ``n_updates`` epochs over them in one call, then their clip fraction (also ``rollout``
        time); its metrics logged and shown."""
        round_, mu = self.round + 1, self.config.n_updates
        start = time.perf_counter()
        with run.timed("rollout"):
            samples, metrics = self.rollout(prompts, rows, prompt_column, round_, more)
        if self.asynchronous:  # the next K rounds' rollouts, to run during the update
            self.engine.ahead(round_ + 1, self.asynchronous.max_off_policy_steps - 1)
        rollout_s, start = time.perf_counter() - start, time.perf_counter()
        during = self.engine.run_dispatched if self.asynchronous else None  # (the rollouts)
        self.trainer.train_scanned(samples, self.batch_size, range((round_ - 1) * mu, round_ * mu),
                                   desc=f"round {round_}/{n_rounds}", during=during)
        update_s = time.perf_counter() - start
        if self.asynchronous:  # the new params onto the rollout mesh, the timeline's row
            self.engine.updated(round_, start, self.trainer.state.params)
        with run.timed("rollout"):
            metrics["clip_fraction"] = self.clip_fraction(samples)
        metrics.update(seconds=rollout_s, update_seconds=update_s,
                       tokens_per_s=metrics["completion_tokens"] * len(samples) / rollout_s)
        self.trainer.deployer.log_metrics({f"rollout/{k}": float(v) for k, v in metrics.items()},
                                          self.trainer.step)
        self.trainer.deployer.log_info(f"round {round_}/{n_rounds}: " + summary(metrics))
        self.round = round_

    def write_samples(self) -> None:
        """The last round's first completions with their rewards, appended to
        ``workdir/samples.jsonl`` (process 0)."""
        deployer = self.trainer.deployer
        if deployer.workdir is None or not deployer.is_main_process or not self.shown:
            return
        with open(os.path.join(deployer.workdir, "samples.jsonl"), "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in self.shown)


def summary(metrics: dict) -> str:
    """A round's metrics in one line for the terminal."""
    kl = f", KL {metrics['kl']:.4f}" if "kl" in metrics else ""
    drawn = (f" over {metrics['prompts_drawn']} prompts drawn ({metrics['groups_dropped']} "
             "groups dropped)") if "prompts_drawn" in metrics else ""
    return (f"reward {metrics['reward']:.3f}{drawn} (group std {metrics['reward_std']:.3f}, "
            f"{metrics['reward_min']:.3f} to {metrics['reward_max']:.3f}), "
            f"{metrics['completion_tokens']:.1f} tokens a completion "
            f"({metrics['cut_at_max_new_tokens']:.0%} cut at max_new_tokens){kl}, clip "
            f"fraction {metrics['clip_fraction']:.3f} after the updates; rollout "
            f"{metrics['seconds']:.1f} s ({metrics['tokens_per_s']:.0f} tokens/s), updates "
            f"{metrics['update_seconds']:.1f} s")
