"""``redco zoo run lm --n_model_shards auto``: the zoo's command line reaches the planner, and
the learning-rate schedule, whose length depends on the layout the planner picks at the first
batch, spans exactly the updates the run makes (by epochs, and by ``--max_steps``)."""
import json
import os

import numpy as np
import pytest
from flax import nnx

from redco.cli import main
from redco_zoo_lm.corpus import write_token_file
from redco_zoo_models import LlamaConfig, LlamaForCausalLM, save_pretrained

EOS = 1


@pytest.fixture
def run(tmp_path):
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    save_pretrained(LlamaForCausalLM(config, nnx.Rngs(0)), str(tmp_path / "config"))
    os.remove(tmp_path / "config" / "model.safetensors")  # a config.json alone
    rng = np.random.default_rng(0)
    docs = [rng.integers(2, 64, rng.integers(4, 40)) for _ in range(120)]
    train = write_token_file(str(tmp_path / "train.bin"), docs, EOS)
    return ["zoo", "run", "lm", "--model", str(tmp_path / "config"), "--from_scratch",
            "--train", train, "--eos_id", str(EOS), "--per_device_batch_size", "1",
            "--block_size", "15", "--n_model_shards", "auto", "--device_memory", "1GB",
            "--learning_rate", "1e-2", "--warmup_rate", "0.2"]


@pytest.mark.parametrize("length", [["--n_epochs", "2"], ["--max_steps", "5"]])
def test_zoo_run_lm_with_auto_shards_plans_the_layout_and_the_schedule_spans_the_run(
        run, length, tmp_path, recwarn):
    workdir = tmp_path / "workdir"
    main(run + length + ["--workdir", str(workdir)])
    log = open(workdir / "log.txt").read()
    assert "layout planner: picked n_model_shards=" in log, log[-2000:]
    steps = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    lrs = [s["train/lr"] for s in steps if "train/lr" in s]
    assert lrs and max(lrs) == np.float32(1e-2) and lrs[-1] == 0, lrs
    assert not [w for w in recwarn if "lr schedule spans" in str(w.message)]


def test_a_number_or_auto_and_nothing_else(run, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([("two" if a == "auto" else a) for a in run] + ["--workdir", str(tmp_path / "w")])
    assert "--n_model_shards: 'two': give a number of devices, or auto" in capsys.readouterr().err
