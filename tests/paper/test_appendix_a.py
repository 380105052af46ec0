"""The paper's Appendix A script (``appendix_a.py``, copied unchanged) runs against this package.

It trains a tiny random BART (Flax, converted from PyTorch weights) on a toy summarization set
over 8 simulated devices with 2 model shards and gradient accumulation, evaluates loss and
beam-search ROUGE after each epoch, and keeps the best rouge2 / rougeL checkpoints.
"""
from __future__ import annotations

import glob
import importlib.util
import json
import math
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "appendix_a.py")
SEED = os.path.join(HERE, "..", "..", "..", "shared", "seeds", "001_f21f1d068ac050f3.txt")


def load_script():
    spec = importlib.util.spec_from_file_location("appendix_a", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def paper_code_blocks(text: str) -> str:
    """The two fenced code blocks of Appendix A, joined by one blank line as in the script."""
    start = text.index("A A Complete Distributed Training Example with Redco")
    parts = text[start:].split("```")
    first, second = parts[1], parts[3]
    return first.strip("\n") + "\n\n" + second.strip("\n") + "\n"


@pytest.mark.skipif(not os.path.isfile(SEED), reason="the paper's text (shared/seeds) is absent")
def test_script_is_the_papers_unchanged():
    with open(SEED) as f:
        paper = paper_code_blocks(f.read())
    with open(SCRIPT) as f:
        script = f.read()
    assert script.strip() == paper.strip()


def test_appendix_a_trains_evaluates_and_checkpoints(paper_assets, tmp_path, monkeypatch):
    monkeypatch.chdir(paper_assets["cwd"])  # where evaluate.load('rouge') finds rouge/rouge.py
    script = load_script()
    workdir = tmp_path / "workdir"
    script.main(
        dataset_name=paper_assets["data"],
        src_key="src",
        tgt_key="tgt",
        model_name_or_path=paper_assets["model"],
        n_model_shards=2,
        n_epochs=2,
        per_device_batch_size=1,
        eval_per_device_batch_size=1,
        accumulate_grad_batches=2,
        max_src_len=16,
        max_tgt_len=8,
        num_beams=2,
        learning_rate=1e-3,
        warmup_rate=0.1,
        workdir=str(workdir),
    )

    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    train = [r for r in rows if "train/loss" in r]
    evals = [r for r in rows if "eval/rouge2" in r]
    # 32 examples, 4 dp groups x 1 per device x 2 accumulated micro-batches: 4 updates an epoch.
    assert [r["step"] for r in train] == list(range(1, 9))
    assert all(math.isfinite(r["train/loss"]) for r in train)
    assert train[-1]["train/loss"] < train[0]["train/loss"]
    assert [r["step"] for r in evals] == [4, 8]
    for r in evals:
        assert math.isfinite(r["eval/loss"])
        for key in ("eval/rouge1", "eval/rouge2", "eval/rougeL"):
            assert 0.0 <= r[key] <= 1.0

    ckpts = workdir / "ckpts"
    for name in ("best_rouge2", "best_rougeL"):
        meta = json.loads((ckpts / name / "meta.json").read_text())
        assert meta["step"] in (4, 8)
        assert glob.glob(str(ckpts / name / "state" / "*"))
    assert json.loads((ckpts / "step_8" / "meta.json").read_text())["step"] == 8  # last ckpt
    assert not glob.glob(str(ckpts / "*.tmp"))
