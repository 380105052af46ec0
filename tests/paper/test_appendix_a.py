"""The paper's Appendix A script (``appendix_a.py``, copied unchanged) runs against this package.

It trains a tiny random BART (Flax, converted from PyTorch weights) on a toy summarization set
over 8 simulated devices with 2 model shards and gradient accumulation, evaluates loss and
beam-search ROUGE after each epoch, and keeps the best rouge2 / rougeL checkpoints.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os

import jax

from redco import hookimpl
from redco.plugins import pm

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "appendix_a.py")
# sha256 of the two fenced code blocks of the paper's Appendix A ("A Complete Distributed Training
# Example with Redco", RedCoast, arXiv:2310.16355), joined by one blank line and stripped: taken
# from the paper's text when appendix_a.py was copied. The fixture is the reference from then on.
PAPER_SHA256 = "2593f38a468be5c2da88ebb4a535405ffb10164a36e13a8fe865a2f7e8931f4d"


def load_script():
    spec = importlib.util.spec_from_file_location("appendix_a", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_script_is_the_papers_unchanged():
    """Any edit to the fixture (even to make it pass) changes its hash."""
    with open(SCRIPT) as f:
        script = f.read()
    assert hashlib.sha256(script.strip().encode()).hexdigest() == PAPER_SHA256


class FitRecorder:
    """A redco plugin (hooks only, nothing patched) that keeps the trainer the script built."""

    def __init__(self):
        self.trainer, self.evals = None, []

    @hookimpl
    def on_eval_end(self, trainer, epoch, metrics):
        self.evals.append((trainer.step, dict(metrics)))

    @hookimpl
    def on_fit_end(self, trainer):
        self.trainer = trainer


def test_appendix_a_trains_evaluates_and_checkpoints(paper_assets, tmp_path, monkeypatch):
    monkeypatch.chdir(paper_assets["cwd"])  # where evaluate.load('rouge') finds rouge/rouge.py
    script = load_script()
    workdir = tmp_path / "workdir"
    recorder = FitRecorder()
    pm.register(recorder)
    try:
        script.main(
            dataset_name=paper_assets["data"],
            src_key="src",
            tgt_key="tgt",
            model_name_or_path=paper_assets["model"],
            n_model_shards=2,
            n_epochs=2,
            per_device_batch_size=1,
            eval_per_device_batch_size=1,
            accumulate_grad_batches=2,  # the script wraps adamw in optax.MultiSteps
            max_src_len=16,
            max_tgt_len=8,
            num_beams=2,
            learning_rate=1e-2,
            warmup_rate=0.1,
            workdir=str(workdir),
        )
    finally:
        pm.unregister(recorder)

    # The mesh is 4 (dp) x 2 (mp), and the auto rules really split the BART over mp.
    trainer = recorder.trainer
    assert dict(trainer.deployer.mesh.shape) == {"dp": 4, "mp": 2}
    specs = [leaf.sharding.spec for leaf in jax.tree.leaves(trainer.params)]
    assert any("mp" in spec for spec in specs)

    with open(workdir / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    train = [r for r in rows if "train/loss" in r]
    evals = [r for r in rows if "eval/rouge2" in r]
    # 256 examples, 4 dp groups x 1 per device x 2 accumulated micro-batches: 32 updates an epoch.
    assert [r["step"] for r in train] == list(range(1, 65))
    assert all(math.isfinite(r["train/loss"]) for r in train)
    assert train[-1]["train/loss"] < train[0]["train/loss"] / 2
    assert [r["step"] for r in evals] == [32, 64]
    assert evals[-1]["eval/loss"] < evals[0]["eval/loss"]
    for r in evals:
        assert math.isfinite(r["eval/loss"])
        for key in ("eval/rouge1", "eval/rouge2", "eval/rougeL"):
            assert 0.0 <= r[key] <= 1.0
    # Beam search produced real text: the metric module scored n-grams shared with the targets.
    assert max(r["eval/rouge2"] for r in evals) > 0
    assert [(step, m["rouge2"]) for step, m in recorder.evals] == \
        [(r["step"], r["eval/rouge2"]) for r in evals]

    ckpts = workdir / "ckpts"
    for name in ("rouge2", "rougeL"):
        meta = json.loads((ckpts / f"best_{name}" / "meta.json").read_text())
        best = max(evals, key=lambda r: r[f"eval/{name}"])  # the first best, as saved
        assert (meta["step"], meta[name]) == (best["step"], best[f"eval/{name}"])
        assert os.listdir(ckpts / f"best_{name}" / "state")
    last = json.loads((ckpts / "step_64" / "meta.json").read_text())
    assert (last["step"], last["epoch"]) == (64, 1)
    assert sorted(os.listdir(ckpts)) == ["best_rouge2", "best_rougeL", "step_64"]
