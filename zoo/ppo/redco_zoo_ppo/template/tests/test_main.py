"""Runs out of the box: 8 simulated CPU devices, a short PPO run, checks a broken setup fails."""
import json
import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import main  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


def test_a_short_run_updates_the_policy_and_records_episodes(tmp_path):
    trainer, returns = main.train(total_steps=512, n_envs=4, n_steps=32, n_model_shards=2,
                                  workdir=str(tmp_path))
    assert trainer.step == 4 * 4 * 4  # iterations x epochs x minibatches
    assert len(returns) >= 5 and np.mean(returns) > 10  # a random policy balances ~22 steps
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(losses) == trainer.step and np.isfinite(losses).all()
    first = main.init_params(jax.random.PRNGKey(0), 4, 2)["actor"][0]["kernel"]
    assert not np.allclose(np.asarray(trainer.params["actor"][0]["kernel"]), first)


def test_too_few_steps_for_one_rollout_is_an_error_that_says_so(tmp_path):
    with pytest.raises(ValueError, match="raise total_steps"):
        main.train(total_steps=64, n_envs=4, n_steps=32, workdir=str(tmp_path))
