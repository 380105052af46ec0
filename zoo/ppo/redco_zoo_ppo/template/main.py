"""{{project_name}}: PPO on a gymnasium environment, trained by Redco from three functions.

Run: python main.py [--env_id CartPole-v1 --total_steps 300000 --n_model_shards 1]

The policy (``init_params``, ``apply_fn``), the three functions and ``train``, which calls them,
come from ``redco_zoo_ppo/pipeline.py``, the code ``redco zoo run ppo`` runs: to change one, copy
it and ``train`` from there into this file in place of the import of ``train``.
``redco_zoo_ppo.Collector`` steps the vectorised envs with ``pred_fn`` (jitted, on one device)
and computes GAE advantages (gamma 0.98, lambda 0.8); ``Trainer`` runs the updates on every local
device and logs them to ``workdir/metrics.jsonl``.
"""
import argparse

import numpy as np

from redco_zoo_ppo.pipeline import add_arguments, pred_fn, train  # noqa: F401 (tests use main.pred_fn)

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    _, returns = train(**vars(parser.parse_args()))
    print(f"mean return of the last 20 episodes: {np.mean(returns[-20:]):.1f}")
