"""``redco zoo run NAME --config FILE``: a file's settings are the flags' defaults, the command
line wins, what the run resolved is written to the workdir, a rerun says what changed, and a
setting the pipeline has not is refused naming the closest (``redco/run_config.py``)."""
import json

import numpy as np
import pytest

from redco.cli import main
from redco_zoo_models.toy import save_model_dir, tiny_llama, word_tokenizer

WORDS = "zero one two three four five six seven eight nine".split()


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    root = tmp_path_factory.mktemp("run_config")
    tokenizer = word_tokenizer(WORDS, ("<pad>", "</s>", "<unk>", "<s>"))
    save_model_dir(tiny_llama(tokenizer.get_vocab_size()), tokenizer, str(root / "model"))
    starts = np.random.default_rng(0).integers(0, 10, 40)
    (root / "train.txt").write_text("".join(
        " ".join(WORDS[(s + i) % 10] for i in range(40)) + "\n" for s in starts))
    return root


def steps_logged(workdir) -> list[int]:
    with open(workdir / "metrics.jsonl") as f:
        return [row["step"] for row in map(json.loads, f) if "train/loss" in row]


@pytest.mark.parametrize("kind", ["yaml", "toml", "json"])
def test_a_config_file_sets_the_flags_and_the_command_line_wins(lm, tmp_path, capsys, kind):
    settings = {"model": str(lm / "model"), "train": str(lm / "train.txt"), "max_steps": 3,
                "block_size": 16, "per_device_batch_size": 1, "learning_rate": 0.003}
    path = tmp_path / f"run.{kind}"
    if kind == "json":
        path.write_text(json.dumps(settings))
    else:
        sep = ": " if kind == "yaml" else " = "
        path.write_text("".join(f"{k}{sep}{json.dumps(v)}\n" for k, v in settings.items()))
    workdir = tmp_path / "run"
    main(["zoo", "run", "lm", "--config", str(path), "--workdir", str(workdir),
          "--learning_rate", "0.001"])
    assert steps_logged(workdir) == [1, 2, 3]  # max_steps from the file
    resolved = json.loads((workdir / "run_config.json").read_text())
    assert resolved["learning_rate"] == 0.001 and resolved["block_size"] == 16
    assert resolved["n_epochs"] == 2  # a flag neither gave: its default
    if kind != "yaml":
        return
    main(["zoo", "run", "lm", "--config", str(path), "--workdir", str(workdir)])  # a rerun
    assert "Settings changed since the run before in" in capsys.readouterr().out
    log = json.loads((workdir / "run_config.json").read_text())
    assert log["learning_rate"] == 0.003


def test_a_setting_the_pipeline_has_not_is_refused_naming_the_closest(lm, tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(f"model: {lm / 'model'}\ntrain: {lm / 'train.txt'}\nlerning_rate: 0.1\n")
    with pytest.raises(SystemExit) as stop:
        main(["zoo", "run", "lm", "--config", str(path)])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == 2 and "'lerning_rate' is not a setting of this pipeline (did you " \
        "mean 'learning_rate'?)" in line, line
    path.write_text("optimizer:\n  lr: 0.1\n")
    with pytest.raises(SystemExit):
        main(["zoo", "run", "lm", "--config", str(path)])
    assert "write flat `name: value` lines" in capsys.readouterr().err
