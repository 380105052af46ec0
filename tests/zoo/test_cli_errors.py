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


def test_debug_shows_the_traceback():
    result = redco("new", "--template", "nope", "proj", debug=True)
    assert result.returncode == 1 and "Traceback" in result.stderr
    assert "NotRegistered: No templates named 'nope'" in result.stderr


# ---- in-process (``redco.cli.main``): the same one line and exit 2, without a new Python ------
def main_err(capsys, *args) -> list[str]:
    """The lines ``redco.cli.main(args)`` writes to stderr, exiting with status 2."""
    from redco.cli import main
    with pytest.raises(SystemExit) as stop:
        main(list(args))
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and err, err
    return err


def main_says(capsys, *args) -> str:
    return main_err(capsys, *args)[-1]


def main_says_one_line(capsys, *args) -> str:
    err = main_err(capsys, *args)
    assert len(err) == 1, err
    return err[0]


def test_a_model_folder_that_is_not_there_or_not_a_model_names_the_fix(lm_dir, capsys,
                                                                        tmp_path):
    line = main_says(capsys, "zoo", "run", "lm", "--model", str(tmp_path / "nope"), "--train",
                     str(lm_dir / "data.jsonl"))
    assert "--model" in line and "nope: no such directory" in line and "--from_scratch" in line
    os.makedirs(tmp_path / "empty")
    line = main_says(capsys, "zoo", "run", "lm", "--model", str(tmp_path / "empty"), "--train",
                     str(lm_dir / "data.jsonl"))
    assert "the directory has no config.json" in line
    os.makedirs(tmp_path / "bert")
    with open(tmp_path / "bert" / "config.json", "w") as f:
        json.dump({"model_type": "bert"}, f)
    line = main_says(capsys, "zoo", "run", "lm", "--model", str(tmp_path / "bert"), "--train",
                     str(lm_dir / "data.jsonl"))
    assert "holds a 'bert' model; the zoo reads [" in line and "families.py" in line


# (in-process: the same exit path as test_missing_data_file's subprocess, without its start-up)
def test_unknown_column_lists_the_columns(lm_dir, capsys):
    line = main_says_one_line(capsys, "zoo", "run", "lm", "--model", str(lm_dir / "model"),
                              "--train", str(lm_dir / "data.jsonl"), "--text_column", "content")
    assert "--text_column 'content'" in line and "Its columns: ['text']" in line, line


def test_data_too_small_for_the_block_size(lm_dir, capsys):
    # the 2 held-out rows (the last 5%) are about 20 tokens: too few for 128 + 1
    line = main_says_one_line(capsys, "zoo", "run", "lm", "--model", str(lm_dir / "model"),
                              "--train", str(lm_dir / "data.jsonl"), "--workdir", str(lm_dir / "w"))
    assert "--eval (or the last 5% of --train) is " in line, line
    assert "too few for one example of --block_size 128" in line, line


def test_a_mistyped_flag_names_the_one_meant(lm_dir, capsys):
    line = main_says(capsys, "zoo", "run", "lm", "--model", str(lm_dir / "model"), "--train",
                     str(lm_dir / "data.jsonl"), "--lerning_rate", "3e-4")
    assert line.endswith("unrecognized arguments: --lerning_rate 3e-4 (did you mean "
                         "--learning_rate?)"), line
    line = main_says(capsys, "new", "--tempalte", "lm", "--lsit")
    assert line.endswith("(did you mean --template for --tempalte, --list for --lsit?)"), line


def test_preference_rows_without_chosen_or_rejected_name_what_they_need(tmp_path, capsys):
    from redco_zoo_models.toy import save_tiny_chat_model
    model = save_tiny_chat_model(str(tmp_path / "chat"), WORDS)
    with open(tmp_path / "pairs.jsonl", "w") as f:
        for _ in range(4):
            f.write(json.dumps({"prompt": [{"role": "user", "content": "the cat"}],
                                "good": "sat", "bad": "ran"}) + "\n")
    line = main_says(capsys, "zoo", "run", "dpo", "--model", model, "--train",
                     str(tmp_path / "pairs.jsonl"), "--workdir", str(tmp_path / "run"))
    assert "has no chosen or rejected (its keys: ['bad', 'good', 'prompt'])" in line
    assert "each row needs 'prompt'" in line


def test_version():
    from importlib.metadata import version
    result = redco("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"redco {version('redco')}"
