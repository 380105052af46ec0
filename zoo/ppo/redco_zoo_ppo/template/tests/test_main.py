"""Runs out of the box: 8 simulated CPU devices, a short PPO run whose policy, played on fresh
CartPole-v1 episodes, balances the pole several times longer than a random policy measured on
the same episodes; a setup that does not learn (no policy gradient, no updates) fails here."""
import json
import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import gymnasium as gym  # noqa: E402
import jax  # noqa: E402
import main  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


def mean_return(choose, n_episodes: int = 20, seed: int = 10_000) -> float:
    """Mean return of CartPole-v1 episodes reset with seeds ``seed``, ``seed + 1``, ...;
    ``choose(obs, rng)`` picks each action (``rng``: a numpy Generator seeded with ``seed``)."""
    env, rng, returns = gym.make("CartPole-v1"), np.random.default_rng(seed), []
    for i in range(n_episodes):
        obs, total, done = env.reset(seed=seed + i)[0], 0.0, False
        while not done:
            obs, reward, terminated, truncated, _ = env.step(choose(obs, rng))
            total, done = total + reward, terminated or truncated
        returns.append(total)
    env.close()
    return float(np.mean(returns))


def policy(params):
    """``choose`` for ``mean_return``: an action sampled by the template's ``pred_fn``."""
    act = jax.jit(main.pred_fn)
    return lambda obs, rng: int(act(jax.random.PRNGKey(rng.integers(2 ** 31)), params,
                                    {"obs": obs[None]})["action"][0])


def test_a_short_run_learns_to_balance_far_longer_than_a_random_policy(tmp_path):
    trainer, returns = main.train(total_steps=8192, n_envs=8, n_steps=32, n_model_shards=2,
                                  workdir=str(tmp_path))
    assert trainer.step == 32 * 4 * 4  # iterations x epochs x minibatches
    trained = mean_return(policy(jax.device_get(trainer.params)))
    random = mean_return(lambda obs, rng: int(rng.integers(2)))  # left or right, 50:50
    print(f"mean return over 20 episodes: trained {trained:.1f}, random {random:.1f}")
    # Measured on these 20 episodes: random 21.1; trained 310.8 (seed 0; seeds 1-3: 123, 129,
    # 167). A policy that has not learnt stays near random; 4x random (84) and 100 (below every
    # seed's) leave room for drift and are far above what an unlearnt policy reaches.
    assert trained >= max(4 * random, 100), (trained, random)
    assert len(returns) >= 5
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(losses) == trainer.step and np.isfinite(losses).all()


def test_too_few_steps_for_one_rollout_is_an_error_that_says_so(tmp_path):
    with pytest.raises(ValueError, match="raise total_steps"):
        main.train(total_steps=64, n_envs=4, n_steps=32, workdir=str(tmp_path))
