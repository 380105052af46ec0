"""PPO learns CartPole-v1 (mean return of the last 20 episodes >= 450 of the 500 an episode can
reach, by 300k env steps, against ~22 for a random policy measured here) on 8 devices; ``redco
zoo`` lists and runs it (its template's project: tests/templates)."""
import os
import re
import signal
import sys
import time

import gymnasium as gym
import jax
import numpy as np
import pytest

from redco.cli import main
from redco.preemption import Preempted
from redco_zoo_ppo import Collector, train

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kill_anywhere import assert_same_arrays, killed_twice_and_rerun, newest_step_arrays, redco_cmd  # noqa: E402, I001

SEED = 0  # seeds 0-5 all reach 500 by ~100k env steps here and stay there


def random_policy_mean_return(n_episodes: int = 100, seed: int = 10_000) -> float:
    """CartPole-v1 episodes (reset seeds ``seed``, ``seed + 1``, ...) played by 50:50 left/right."""
    env, rng, returns = gym.make("CartPole-v1"), np.random.default_rng(seed), []
    for i in range(n_episodes):
        env.reset(seed=seed + i)
        total, done = 0.0, False
        while not done:
            _, reward, terminated, truncated, _ = env.step(int(rng.integers(2)))
            total, done = total + reward, terminated or truncated
        returns.append(total)
    return float(np.mean(returns))


@pytest.mark.slow  # REDCO_SLOW_TESTS=1 (conftest.py)
def test_ppo_balances_cartpole_within_300k_env_steps(workdir):
    start = time.perf_counter()
    trainer, returns = train("CartPole-v1", total_steps=300_000, n_envs=16, n_steps=64, seed=SEED,
                             workdir=workdir, verbose=False)
    mean, random = float(np.mean(returns[-20:])), random_policy_mean_return()
    print(f"CartPole-v1, seed {SEED}: mean return of the last 20 episodes {mean:.1f} after "
          f"{300_000 // 1024 * 1024} env steps ({trainer.step} updates) in "
          f"{time.perf_counter() - start:.0f} s; a random policy {random:.1f}")
    # Episodes end at 500 steps (the time limit): the last 20 training episodes (sampled actions)
    # must average 90% of that ceiling, and 10x the random policy measured above (~22). A policy
    # that has not learnt, or stopped learning early, stays far below both.
    assert mean >= 450 and mean >= 10 * random, (returns[-20:], random)


def test_redco_zoo_lists_and_runs_ppo(workdir, capsys):
    main(["zoo", "list"])
    assert any(line.split()[:1] == ["ppo"] for line in capsys.readouterr().out.splitlines())
    main(["zoo", "run", "ppo", "--total_steps", "2048", "--n_envs", "4", "--n_model_shards", "2",
          "--workdir", workdir])
    out = capsys.readouterr().out
    assert "mean return of the last 20 episodes" in out, out
    assert re.search(r"iteration 8/8: mean return of the last 20 episodes [\d.]+; rollout [\d.]+ s, "
                     r"updates [\d.]+ s", out), out  # each iteration's line
    assert os.path.exists(os.path.join(workdir, "metrics.jsonl"))


def test_a_ppo_run_stopped_by_sigterm_resumes_to_the_same_bits(tmp_path, monkeypatch):
    """4 iterations of 16 updates; SIGTERM during iteration 2's rollout: it ends, step 32 is
    saved (with the envs mid-episode), ``Preempted`` (143); the rerun resumes there and ends with
    the params and episode returns of a run never stopped."""
    def run(workdir):
        trainer, returns = train("CartPole-v1", total_steps=4 * 1024, seed=SEED,
                                 workdir=str(workdir), verbose=False)
        return jax.device_get(trainer.params), returns
    whole = run(tmp_path / "whole")
    rollout, calls = Collector.rollout, []
    def stopping_rollout(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return rollout(self, *args, **kwargs)
    monkeypatch.setattr(Collector, "rollout", stopping_rollout)
    with pytest.raises(Preempted, match="") as stopped:
        run(tmp_path / "cut")
    assert stopped.value.code == 143 and "after step 32" in stopped.value.reason
    monkeypatch.setattr(Collector, "rollout", rollout)
    cut = run(tmp_path / "cut")
    assert "Resumed from" in (tmp_path / "cut" / "log.txt").read_text()
    assert cut[1] == whole[1]
    jax.tree.map(np.testing.assert_array_equal, cut[0], whole[0])


def test_a_ppo_run_killed_at_random_moments_reruns_to_the_same_bits(tmp_path):
    """``redco zoo run ppo`` (4 iterations of 16 updates, a checkpoint each) SIGKILLed twice at
    random moments, each after it saved an iteration, then rerun to its end: the last step
    checkpoint (params, optimizer state, step) and the returns equal an uninterrupted run's."""
    cmd = lambda workdir: redco_cmd("zoo", "run", "ppo", "--total_steps", "4096",  # noqa: E731
                                    "--save_every_n_steps", "16", "--workdir", workdir)
    whole, cut, whole_out, cut_out = killed_twice_and_rerun(cmd, tmp_path)
    assert cut_out.splitlines()[-1] == whole_out.splitlines()[-1]
    assert_same_arrays(newest_step_arrays(cut), newest_step_arrays(whole))
