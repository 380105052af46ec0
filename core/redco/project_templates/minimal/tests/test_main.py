"""Runs out of the box: 8 simulated CPU devices, a short training, a loss a broken setup misses."""
import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import main  # noqa: E402


def test_trains_below_the_variance_of_the_target(tmp_path):
    loss = main.main(n_model_shards=2, n_epochs=3, workdir=str(tmp_path))
    assert loss < 0.1  # predicting 0 everywhere scores about 0.5 (the variance of sin x)
    assert os.path.isdir(tmp_path / "ckpts" / "best_loss")
