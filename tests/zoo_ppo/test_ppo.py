"""PPO learns CartPole-v1 (mean return of the last 20 episodes >= 450 by 300k env steps) on 8
devices; ``redco zoo`` lists and runs it (its template's project: tests/templates)."""
import os
import time

import numpy as np

from redco.cli import main
from redco_zoo_ppo import train

SEED = 0  # seeds 0-5 all reach 500 by ~100k env steps here and stay there


def test_ppo_balances_cartpole_within_300k_env_steps(workdir):
    start = time.perf_counter()
    trainer, returns = train("CartPole-v1", total_steps=300_000, n_envs=16, n_steps=64, seed=SEED,
                             workdir=workdir, verbose=False)
    mean = float(np.mean(returns[-20:]))
    print(f"CartPole-v1, seed {SEED}: mean return of the last 20 episodes {mean:.1f} after "
          f"{300_000 // 1024 * 1024} env steps ({trainer.step} updates) in "
          f"{time.perf_counter() - start:.0f} s")
    assert mean >= 450, returns[-20:]


def test_redco_zoo_lists_and_runs_ppo(workdir, capsys):
    main(["zoo", "list"])
    assert any(line.split()[:1] == ["ppo"] for line in capsys.readouterr().out.splitlines())
    main(["zoo", "run", "ppo", "--total_steps", "2048", "--n_envs", "4", "--n_model_shards", "2",
          "--workdir", workdir])
    out = capsys.readouterr().out
    assert "mean return of the last 20 episodes" in out, out
    assert os.path.exists(os.path.join(workdir, "metrics.jsonl"))
