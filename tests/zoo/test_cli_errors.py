"""A user's mistake on the command line gets one line on stderr naming it, and exit status 2;
``--debug`` shows the traceback instead. Run as a user runs them: ``redco`` in a subprocess."""
import json
import os
import subprocess
import sys

import pytest

from redco_zoo_models.toy import save_model_dir, tiny_llama, word_tokenizer

WORDS = "the cat sat on a mat and then it ran off".split()


def redco(*args, debug=False):
    env = {**os.environ, "REDCO_DEBUG": "1" if debug else ""}
    return subprocess.run([sys.executable, "-m", "redco.cli", *args], capture_output=True,
                          text=True, env=env, timeout=300)


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    """A tiny model and ``data.jsonl`` (column ``text``, 40 rows of 10 words)."""
    root = tmp_path_factory.mktemp("cli")
    tokenizer = word_tokenizer(WORDS)
    save_model_dir(tiny_llama(tokenizer.get_vocab_size()), tokenizer, str(root / "model"))
    with open(root / "data.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"text": " ".join(WORDS[i % 3:] + WORDS[:i % 3])}) + "\n")
    return root


def one_line(result, *expected):
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def test_unknown_template():
    one_line(redco("new", "--template", "nope", "proj"),
             "redco new: No templates named 'nope'", "minimal")


def test_missing_data_file(lm_dir):
    one_line(redco("zoo", "run", "lm", "--model", str(lm_dir / "model"), "--train",
                   str(lm_dir / "missing.jsonl")), "missing.jsonl: no such file or folder")


def test_unknown_column_lists_the_columns(lm_dir):
    one_line(redco("zoo", "run", "lm", "--model", str(lm_dir / "model"), "--train",
                   str(lm_dir / "data.jsonl"), "--text_column", "content"),
             "--text_column 'content'", "Its columns: ['text']")


def test_data_too_small_for_the_block_size(lm_dir):
    # the 2 held-out rows (the last 5%) are about 20 tokens: too few for 128 + 1
    one_line(redco("zoo", "run", "lm", "--model", str(lm_dir / "model"), "--train",
                   str(lm_dir / "data.jsonl"), "--workdir", str(lm_dir / "w")),
             "--eval (or the last 5% of --train) is ", "too few for one example of --block_size 128")


def test_debug_shows_the_traceback():
    result = redco("new", "--template", "nope", "proj", debug=True)
    assert result.returncode == 1 and "Traceback" in result.stderr
    assert "NotRegistered: No templates named 'nope'" in result.stderr
