"""main.py trains a tiny LLaMA, made here (no hub), on text that counts in words, on 8 simulated
CPU devices with the model split in two: the eval perplexity nears 1, a prompt is continued
by counting on, and the trained model is saved and loads back; with --lora_rank only adapters
train and the model is saved merged, the adapters in PEFT's layout; from scratch on the same text
tokenized into a token file, for --max_steps updates."""
import json
import os

# before jax starts
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import main  # noqa: E402
import numpy as np  # noqa: E402

from redco_zoo_models import LlamaForCausalLM, from_pretrained  # noqa: E402
from redco_zoo_models.toy import save_model_dir, tiny_llama, word_tokenizer  # noqa: E402

NUMBERS = "zero one two three four five six seven eight nine".split()


def write_text(path, n_lines, seed):
    """Lines of 40 words counting on from a random number, wrapping after nine."""
    starts = np.random.default_rng(seed).integers(0, 10, n_lines)
    with open(path, "w") as f:
        f.writelines(" ".join(NUMBERS[(s + i) % 10] for i in range(40)) + "\n" for s in starts)


def model_and_text(tmp_path, n_train: int, n_eval: int) -> str:
    """A tiny LLaMA directory and counting text in train.txt and dev.txt; the model's path."""
    # pad 0, eos 1, unk 2, bos 3, then the words: 14 ids split over 2 shards
    tokenizer = word_tokenizer(NUMBERS, ("<pad>", "</s>", "<unk>", "<s>"))
    write_text(tmp_path / "train.txt", n_train, seed=0)
    write_text(tmp_path / "dev.txt", n_eval, seed=1)
    return save_model_dir(tiny_llama(tokenizer.get_vocab_size()), tokenizer,
                          str(tmp_path / "llama"))


def test_main_learns_to_count(tmp_path):
    model_dir = model_and_text(tmp_path, 256, 32)
    workdir = tmp_path / "workdir"
    perplexity, samples = main.main(main.parse_args([
        "--model", model_dir, "--train", str(tmp_path / "train.txt"), "--eval",
        str(tmp_path / "dev.txt"), "--workdir", str(workdir), "--n_model_shards", "2",
        "--per_device_batch_size", "4", "--n_epochs", "3", "--learning_rate", "3e-3",
        "--block_size", "16", "--prompt", "six seven", "--max_new_tokens", "4"]))

    assert "mesh: {'dp': 4, 'mp': 2}" in (workdir / "log.txt").read_text()
    with open(workdir / "metrics.jsonl") as f:
        losses = [row["train/loss"] for row in map(json.loads, f) if "train/loss" in row]
    assert np.mean(losses[-5:]) < 0.2 * np.mean(losses[:5]), losses
    assert perplexity < 1.5, perplexity  # an untrained model is near the vocabulary size, 14
    assert samples["six seven"] == "eight nine zero one", samples
    trained = from_pretrained(LlamaForCausalLM, str(workdir / "model"))
    assert os.path.isfile(workdir / "model" / "tokenizer.json") and trained.cfg.vocab_size == 14


def test_main_with_lora_trains_only_adapters(tmp_path):
    model_dir = model_and_text(tmp_path, 128, 16)
    workdir = tmp_path / "workdir"
    perplexity, _ = main.main(main.parse_args([
        "--model", model_dir, "--train", str(tmp_path / "train.txt"), "--eval",
        str(tmp_path / "dev.txt"), "--workdir", str(workdir), "--n_model_shards", "2",
        "--per_device_batch_size", "4", "--n_epochs", "2", "--learning_rate", "1e-2",
        "--block_size", "16", "--lora_rank", "4"]))
    assert "LoRA rank 4" in (workdir / "log.txt").read_text()
    assert perplexity < 4, perplexity  # an untrained model is near the vocabulary size, 14
    assert sorted(os.listdir(workdir / "adapter")) == ["adapter_config.json",
                                                      "adapter_model.safetensors"]
    trained = from_pretrained(LlamaForCausalLM, str(workdir / "model"))  # merged: a plain model
    assert trained.cfg.vocab_size == 14


def test_main_from_scratch_on_a_token_file_for_max_steps(tmp_path):
    from redco.cli import main as redco
    model_dir = model_and_text(tmp_path, 256, 32)
    redco(["tokenize", str(tmp_path / "train.txt"), "--tokenizer", model_dir, "--out",
           str(tmp_path / "train.bin")])  # a line a document, each ending in </s>
    workdir = tmp_path / "workdir"
    perplexity, _ = main.main(main.parse_args([
        "--model", model_dir, "--from_scratch", "--train", str(tmp_path / "train.bin"),
        "--workdir", str(workdir), "--per_device_batch_size", "4", "--max_steps", "60",
        "--learning_rate", "3e-3", "--block_size", "16"]))
    with open(workdir / "metrics.jsonl") as f:
        steps = [row["step"] for row in map(json.loads, f) if "train/loss" in row]
    assert steps == list(range(1, 61))  # 60 updates over epochs of packed rows read from disk
    assert perplexity < 2, perplexity  # an untrained model is near the vocabulary size, 14
