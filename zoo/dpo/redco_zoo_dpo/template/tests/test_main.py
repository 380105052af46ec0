"""main.py trains a tiny LLaMA, made here with a word-level tokenizer and the ChatML chat template
(no hub), on preference pairs where the user says x_i and the chosen reply is y_(3i mod 20), the
rejected one another y, on 8 simulated CPU devices with the model split in two: with LoRA
adapters (the reference: the adapters off), held-out preference accuracy reaches 0.9 or more."""
import json
import os

# before jax starts
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import main  # noqa: E402
import numpy as np  # noqa: E402

from redco_zoo_models.toy import save_model_dir, tiny_llama  # noqa: E402

OPEN, CLOSE = "{" * 2, "}" * 2  # (written so: redco new reads doubled braces as its own)
CHATML = ("{% for m in messages %}<|im_start|>" + OPEN + " m['role'] " + CLOSE + "\n" + OPEN
          + " m['content'] " + CLOSE + "<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # ChatML
SPECIALS = ["<pad>", "<|im_end|>", "<unk>", "<|im_start|>"]
WORDS = ["system", "user", "assistant", "map"] + [f"x{i}" for i in range(20)] + \
    [f"y{i}" for i in range(20)]


def model_dir(tmp_path) -> str:
    """A tiny LLaMA and its chat tokenizer, saved as a HuggingFace directory."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(SPECIALS + WORDS)},
                                     unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=CHATML,
                                        pad_token="<pad>", eos_token="<|im_end|>")
    path = save_model_dir(tiny_llama(len(SPECIALS) + len(WORDS)), tok, str(tmp_path / "llama"))
    tokenizer.save_pretrained(path)  # tokenizer_config.json, with the chat template
    return path


def write_pairs(path, n, seed):
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for k in rng.integers(0, 20, n):
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"x{k}"}],
                                "chosen": f"y{3 * k % 20}",
                                "rejected": f"y{(3 * k + rng.integers(1, 20)) % 20}"}) + "\n")


def test_main_learns_the_preferences(tmp_path):
    write_pairs(tmp_path / "train.jsonl", 400, seed=0)
    write_pairs(tmp_path / "dev.jsonl", 100, seed=1)
    workdir = tmp_path / "workdir"
    metrics = main.main(main.parse_args([
        "--model", model_dir(tmp_path), "--train", str(tmp_path / "train.jsonl"), "--eval",
        str(tmp_path / "dev.jsonl"), "--workdir", str(workdir), "--n_model_shards", "2",
        "--per_device_batch_size", "2", "--n_epochs", "1", "--learning_rate", "3e-3",
        "--max_len", "16", "--beta", "0.5", "--lora_rank", "8"]))

    assert "mesh: {'dp': 4, 'mp': 2}" in (workdir / "log.txt").read_text()
    assert metrics["accuracy"] >= 0.9 and metrics["margin"] > 0, metrics  # untrained: 0.53
    assert os.path.isfile(workdir / "model" / "config.json")
