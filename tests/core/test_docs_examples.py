"""The runnable examples of the README and of docs/getting-started.md, run as written (8
simulated CPU devices, conftest.py) in a fresh directory: each trains to what its page says."""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from readme_blocks import block  # noqa: E402


def test_the_readmes_minimal_example_trains_a_classifier(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    names = {}
    exec(block("minimal"), names)  # noqa: S102 - the README's own code
    printed = capsys.readouterr().out
    accuracy = float(printed.split("accuracy:")[1].split()[0])
    assert accuracy >= 0.98, printed[-2000:]  # the README: 0.99 on 8 simulated devices
    assert os.path.isfile(tmp_path / "workdir-minimal" / "metrics.jsonl")


def test_getting_starteds_three_functions_learn_the_task_and_keep_the_best(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    names = {}
    exec(block("three-functions", "docs/getting-started.md"), names)  # noqa: S102 - the page's code
    assert dict(names["deployer"].mesh.shape) == {"dp": 4, "mp": 2}
    with open(tmp_path / "workdir" / "eval_results_epoch4.json") as f:
        final = json.load(f)
    assert final["acc"] == 1.0, final  # the page: 1.0 on the held-out examples within 5 epochs
    assert os.path.isdir(tmp_path / "workdir" / "ckpts" / "best_acc")
    # the model is split: some kernel is sharded over the model axis
    specs = [leaf.sharding.spec for leaf in
             __import__("jax").tree.leaves(names["trainer"].params)]
    assert any("mp" in tuple(spec) for spec in specs), specs
    assert np.isfinite(final["loss"])
