"""A few meta-iterations on 8 simulated CPU devices with the MLP split in two: the meta-loss
is finite and falls, and adapting to a held-out task helps."""
import json
import math
import os

# before jax starts
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import main  # noqa: E402


def test_maml_meta_loss_falls_and_adaptation_helps(tmp_path):
    results = main.train(n_meta_iterations=200, meta_batch_size=32, n_model_shards=2,
                         workdir=str(tmp_path), n_eval_tasks=256)
    assert "mesh: {'dp': 4, 'mp': 2}" in (tmp_path / "log.txt").read_text()
    with open(tmp_path / "metrics.jsonl") as f:
        losses = [row["train/loss"] for row in map(json.loads, f) if "train/loss" in row]
    assert len(losses) == 200 and all(map(math.isfinite, losses + list(results.values())))
    first, last = sum(losses[:20]) / 20, sum(losses[-20:]) / 20
    assert last < 0.7 * first, (first, last)
    assert results["post_adaptation_mse"] < results["pre_adaptation_mse"], results
