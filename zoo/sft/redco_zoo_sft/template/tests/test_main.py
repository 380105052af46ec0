"""main.py fine-tunes a tiny LLaMA, made here with a word-level tokenizer and the ChatML chat
template (no hub), on chats where the user says x_i and the assistant answers y_(3i mod 20), on
8 simulated CPU devices with the model split in two: the held-out loss on the assistant's tokens
falls under 0.3 (from 3.9) and the reply to a prompt is the right answer."""
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


def write_chats(path, n, seed):
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(n):
            messages = []
            for k in rng.integers(0, 20, rng.integers(1, 4)):
                messages += [{"role": "user", "content": f"x{k}"},
                             {"role": "assistant", "content": f"y{3 * k % 20}"}]
            f.write(json.dumps({"messages": messages}) + "\n")


def test_main_learns_to_answer(tmp_path):
    write_chats(tmp_path / "train.jsonl", 400, seed=0)
    write_chats(tmp_path / "dev.jsonl", 40, seed=1)
    workdir = tmp_path / "workdir"
    loss, replies = main.main(main.parse_args([
        "--model", model_dir(tmp_path), "--train", str(tmp_path / "train.jsonl"), "--eval",
        str(tmp_path / "dev.jsonl"), "--workdir", str(workdir), "--n_model_shards", "2",
        "--per_device_batch_size", "2", "--n_epochs", "4", "--learning_rate", "3e-3",
        "--max_len", "64", "--prompt", "x7", "--max_new_tokens", "2"]))

    assert "mesh: {'dp': 4, 'mp': 2}" in (workdir / "log.txt").read_text()
    assert loss < 0.3, loss  # untrained: about 3.9, ln of the vocabulary (4 epochs: 0.052)
    assert replies["x7"] == "y1", replies  # 3 * 7 mod 20; the end of turn is not shown
    assert os.path.isfile(workdir / "model" / "tokenizer_config.json")
