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


def test_the_training_levers_reach_the_deployer_trainer_and_optimizer(lm, tmp_path):
    """``--n_context_shards``, ``--remat``, ``--compute_dtype``, ``--accumulate_grad_batches``,
    ``--schedule``, ``--weight_decay``, ``--max_grad_norm``, ``--eval_every_n_steps``: each is
    what the trainer that ``train_and_eval`` builds uses, and the run trains."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from redco.cli import Parser
    from redco_zoo_lm.pipeline import LMPipeline, collate_fn, lm_examples, load_lm, loss_fn
    from redco_zoo_lm.settings import LMData
    from redco_zoo_models import runner
    from redco_zoo_models.settings import RunConfig
    parser = Parser()
    LMPipeline().add_arguments(parser)
    args = parser.parse_args([
        "--model", str(lm / "model"), "--train", str(lm / "train.txt"), "--workdir",
        str(tmp_path / "run"), "--block_size", "16", "--per_device_batch_size", "1",
        "--max_steps", "2", "--n_context_shards", "2", "--remat", "full", "--compute_dtype",
        "bfloat16", "--accumulate_grad_batches", "2", "--schedule", "cosine", "--weight_decay",
        "0.5", "--max_grad_norm", "1e-6", "--eval_every_n_steps", "1"])
    seen, config = {}, RunConfig.of_flags(args, LMData)
    model, model_config = load_lm(config)
    trainer = runner.train_and_eval(config, model, lm_examples(config, model_config), collate_fn,
                                    loss_fn, before_fit=lambda t: seen.update(trainer=t))
    assert seen["trainer"] is trainer and trainer.step == 2
    assert trainer.deployer.mesh.shape["cp"] == 2 and trainer.remat == "full"
    assert trainer.compute_dtype == jnp.bfloat16 and trainer.accumulate_grad_batches == 2
    assert (tmp_path / "run" / "eval_results_step1.json").is_file()  # every update
    schedule = trainer.lr_schedule_fn
    assert float(schedule(schedule.total_steps - 1)) == pytest.approx(0.0, abs=1e-9)
    g = {"w": jnp.full((4,), 100.0)}
    params = {"w": jnp.ones(4)}
    for clip, weight_decay in ((2e-8, 0.5), (None, 0.5), (None, 0.0)):
        opt = runner.optimizer_of(dataclasses.replace(
            config.optimizer, max_grad_norm=clip, weight_decay=weight_decay), 1.0)
        update = opt.update(g, opt.init(params), params)[0]["w"]
        seen[(clip, weight_decay)] = float(jax.device_get(update)[0])
    assert seen[(None, 0.5)] == pytest.approx(-1.5, rel=1e-3)  # -(sign(g) + 0.5 * w)
    assert seen[(None, 0.0)] == pytest.approx(-1.0, rel=1e-3)
    # clipped to a norm of 2e-8, each gradient entry is 1e-8, Adam's eps: half a step
    assert seen[(2e-8, 0.5)] == pytest.approx(-1.0, rel=1e-2)


@pytest.mark.parametrize("name, config", [
    ("lm", "redco_zoo_lm/configs/pretrain_llama_1b.yaml"),
    ("sft", "redco_zoo_sft/configs/sft_small.yaml"),
    ("grpo", "redco_zoo_grpo/configs/grpo_small.yaml")])
def test_the_shipped_example_configs_are_whole_runs_of_their_pipelines(name, config):
    """Each zoo job's example config (pretraining a 1B LLaMA shape on a token file, SFT and GRPO
    of a small model), shipped in its package, is read by its pipeline's parser as a complete
    run: every key one of its settings, every required flag given, each value what the run gets
    (the pretraining one reaching the planner, context parallelism, remat, bf16, accumulation,
    the optimizer and the cadences)."""
    import importlib.resources

    from redco import plugins, run_config
    from redco.cli import zoo_parser
    package, _, inside = config.partition("/")
    path = str(importlib.resources.files(package).joinpath(inside))
    settings = run_config.read(path)
    parser = zoo_parser(name, plugins.lookup("zoo_pipelines", name))
    run_config.apply(parser, settings, path)
    args = parser.parse_args([])
    for key, value in settings.items():
        assert getattr(args, key) == value, (key, getattr(args, key), value)
    if name == "lm":
        assert args.n_model_shards == "auto" and args.compute_dtype == "bfloat16"
        assert {"n_context_shards", "remat", "accumulate_grad_batches", "weight_decay",
                "max_grad_norm", "schedule", "save_every_n_steps", "eval_every_n_steps",
                "jax_seed"} <= set(settings)


def test_a_run_built_in_python_needs_no_parser_and_is_the_command_lines_run(lm, tmp_path,
                                                                          monkeypatch):
    """The typed config, built in Python, drives a whole LM run with no argparse anywhere; the
    command line's run of the same settings makes the equal object once (``of_flags``) and
    trains to the same losses; a namespace handed to the library is refused, saying how to
    make the config."""
    import argparse
    import dataclasses

    from redco_zoo_lm import pipeline
    from redco_zoo_lm.pipeline import collate_fn, loss_fn, train_lm
    from redco_zoo_lm.settings import LMData
    from redco_zoo_models import runner
    from redco_zoo_models.settings import Data, Loop, ModelSource, Optimizer, RunConfig

    def losses(workdir) -> list[float]:
        with open(workdir / "metrics.jsonl") as f:
            return [row["train/loss"] for row in map(json.loads, f) if "train/loss" in row]
    config = RunConfig(source=ModelSource(str(lm / "model")), data=Data(str(lm / "train.txt")),
                       workdir=str(tmp_path / "python"), jax_seed=3,
                       optimizer=Optimizer(learning_rate=0.003, schedule="cosine"),
                       loop=Loop(per_device_batch_size=1, max_steps=3, eval_steps=2),
                       task=LMData(block_size=16))
    flags = ["--model", str(lm / "model"), "--train", str(lm / "train.txt"), "--jax_seed", "3",
             "--learning_rate", "0.003", "--schedule", "cosine", "--per_device_batch_size", "1",
             "--max_steps", "3", "--eval_steps", "2", "--block_size", "16"]
    assert np.isfinite(train_lm(config))
    seen = []
    monkeypatch.setattr(pipeline, "train_lm", lambda made: seen.append(made) or train_lm(made))
    main(["zoo", "run", "lm", *flags, "--workdir", str(tmp_path / "cli")])
    assert seen == [dataclasses.replace(config, workdir=str(tmp_path / "cli"))]
    assert losses(tmp_path / "python") == losses(tmp_path / "cli") and \
        len(losses(tmp_path / "cli")) == 3
    with pytest.raises(TypeError, match=r"takes a RunConfig, not a Namespace.*of_flags"):
        runner.train_and_eval(argparse.Namespace(**vars(config)), None, ([], []), collate_fn,
                              loss_fn)


def other_values(parser) -> dict:
    """Every flag of ``parser`` (but the CLI's own) at a value of its kind unlike its default and
    unlike every other flag's."""
    values = {}
    for i, action in enumerate(a for a in parser._actions if a.option_strings and a.dest not in
                               ("help", "config", "loggers")):
        default = action.default
        if action.choices is not None:
            values[action.dest] = next(c for c in action.choices if c != default)
        elif isinstance(default, bool):
            values[action.dest] = not default
        elif isinstance(default, (int, float)):
            values[action.dest] = default + 100 + i
        else:
            values[action.dest] = f"{default}_{i}" if isinstance(default, str) else 100 + i
    return values


@pytest.mark.parametrize("pipeline, task", [
    ("redco_zoo_lm.pipeline:LMPipeline", "redco_zoo_lm.settings:LMData"),
    ("redco_zoo_sft.pipeline:SFTPipeline", "redco_zoo_sft.pipeline:SFTData"),
    ("redco_zoo_dpo.pipeline:DPOPipeline", "redco_zoo_dpo.pipeline:DPOSettings"),
    ("redco_zoo_grpo.pipeline:GRPOPipeline", "redco_zoo_grpo.pipeline:GRPORun"),
    ("redco_zoo_seq2seq.pipeline:Seq2SeqPipeline", "redco_zoo_seq2seq.pipeline:TextPairs"),
    ("redco_zoo_captioning.pipeline:CaptioningPipeline", "redco_zoo_captioning.pipeline:Captions")])
def test_every_flag_of_a_pipeline_is_a_field_of_its_typed_config(pipeline, task):
    """Each pipeline's flags (but the CLI's own ``--config`` and ``--loggers``) land in its
    ``RunConfig``, each in the field of its name (a group's prefix prepended), at its value,
    every flag at a value of its own; a flag that no field takes is refused by name (added to
    the parser alone, it would be silently ignored)."""
    import dataclasses
    import importlib

    from redco.cli import zoo_parser
    from redco_zoo_models.settings import RunConfig
    pipeline, task = (getattr(importlib.import_module(path.split(":")[0]), path.split(":")[1])
                      for path in (pipeline, task))
    flags = other_values(zoo_parser("x", pipeline()))
    flags["scan_layers"] = False  # (refused with LoRA, cp and ep: tests/zoo/test_scan_runs.py)
    if "clip_low" in flags:  # GRPO's clip range is checked (tests/zoo/test_grpo_losses.py)
        flags.update(clip_low=0.1, clip_high=0.3)
    config = RunConfig.of_flags(flags, task)

    def leaves(group, prefix=""):
        for field in dataclasses.fields(group):
            value = getattr(group, field.name)
            if dataclasses.is_dataclass(value):
                yield from leaves(value, prefix + field.metadata.get("prefix", ""))
            else:
                yield prefix + field.name, value
    fields = dict(leaves(config))  # (a flag a pipeline has not: its field's default)
    assert {name: fields[name] for name in flags} == flags
    with pytest.raises(TypeError, match=r"takes: \['warmup_ratio'\]"):
        RunConfig.of_flags({**flags, "warmup_ratio": 0.1}, task)


def test_a_typed_config_built_in_python_refuses_a_choice_the_flag_would_refuse():
    """Built in Python, with no argparse to check the choices, a group refuses a value its flag
    would (``bf16`` must not silently run as something else), naming the choices."""
    from redco.protocols import UsageError
    from redco_zoo_models.settings import Layout, Optimizer
    with pytest.raises(UsageError, match=r"Layout\(compute_dtype='bf16'\): choose one of "
                                         r"\['float32', 'bfloat16'\]"):
        Layout(compute_dtype="bf16")
    with pytest.raises(UsageError, match=r"remat='all'.*'full'"):
        Layout(remat="all")
    with pytest.raises(UsageError, match=r"schedule='cos'.*\['linear', 'cosine'\]"):
        Optimizer(schedule="cos")
    assert Layout(compute_dtype="bfloat16", remat="full").remat == "full"
