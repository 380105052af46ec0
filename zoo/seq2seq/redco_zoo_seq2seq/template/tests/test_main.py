"""main.py trains a tiny T5, made here (no hub), to reverse 4-letter strings on 8 simulated CPU
devices with the model split in two; the trained model is saved and loads back."""
import json
import os

# before jax starts
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import main  # noqa: E402
import numpy as np  # noqa: E402

from redco_zoo_models import T5ForConditionalGeneration, from_pretrained  # noqa: E402
from redco_zoo_models.toy import save_model_dir, tiny_t5, word_tokenizer  # noqa: E402

LETTERS = "abcdefghi"  # + 3 specials: a vocabulary of 12 splits over 2 shards


def write_examples(path, n, seed):
    words = np.random.default_rng(seed).choice(list(LETTERS), (n, 4))
    with open(path, "w") as f:
        for w in words:
            f.write(json.dumps({"src": " ".join(w), "tgt": " ".join(w[::-1])}) + "\n")


def test_main_learns_to_reverse_strings(tmp_path):
    tokenizer = word_tokenizer(LETTERS)  # pad 0, eos 1: T5's ids
    model_dir = save_model_dir(tiny_t5(tokenizer.get_vocab_size()), tokenizer, str(tmp_path / "t5"))
    write_examples(tmp_path / "train.jsonl", 2048, seed=0)
    write_examples(tmp_path / "dev.jsonl", 64, seed=1)
    workdir = tmp_path / "workdir"
    main.main(main.parse_args([
        "--model", model_dir, "--train", str(tmp_path / "train.jsonl"), "--eval",
        str(tmp_path / "dev.jsonl"), "--workdir", str(workdir), "--n_model_shards", "2",
        "--per_device_batch_size", "8", "--n_epochs", "5", "--learning_rate", "5e-3",
        "--max_src_len", "5", "--max_tgt_len", "5", "--num_beams", "2"]))

    assert "mesh: {'dp': 4, 'mp': 2}" in (workdir / "log.txt").read_text()
    with open(workdir / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    losses = [row["train/loss"] for row in rows if "train/loss" in row]
    exact_match = [row["eval/exact_match"] for row in rows if "eval/exact_match" in row]
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), losses
    assert exact_match[-1] > 0.6, exact_match
    trained = from_pretrained(T5ForConditionalGeneration, str(workdir / "model"))
    assert os.path.isfile(workdir / "model" / "tokenizer.json") and trained.cfg.num_layers == 2
