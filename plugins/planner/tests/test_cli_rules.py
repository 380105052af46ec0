"""``redco rules``: the sharding plan of a model, printed, from abstract shapes."""
import importlib.util
import json
import re
import subprocess
import sys

import pytest
from jax.sharding import PartitionSpec as P

from redco import Deployer
from redco.cli import main
from redco_planner.inspection import load_model, plan_table, totals

COLUMN, ROW = P(None, "mp"), P("mp", None)


def run_cli(*args):
    """A fresh process, so ``--devices`` really sets the simulated device count."""
    out = subprocess.run([sys.executable, "-m", "redco.cli", *args], capture_output=True,
                         text=True, timeout=300)
    return out


def spec_of(out: str, path: str) -> str:
    line = next(line for line in out.splitlines() if line.startswith(path + " "))
    return re.split(r"\s{2,}", line.strip())[3]


def test_rules_prints_llama_tiny_plan_and_totals():
    """Each layer's own params (``--no_scan_layers``: the unrolled model; the stacked ones'
    rows are test_planner_scan.py's)."""
    out = run_cli("rules", "llama-tiny", "--n_model_shards", "2", "--devices", "8",
                  "--no_scan_layers")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for name in ("q_proj", "k_proj", "v_proj"):
        assert spec_of(text, f"model/layers/0/self_attn/{name}/kernel") == "(None, 'mp')"
    assert spec_of(text, "model/layers/0/self_attn/o_proj/kernel") == "('mp', None)"
    assert spec_of(text, "model/layers/1/mlp/gate_proj/kernel") == "(None, 'mp')"
    assert spec_of(text, "model/layers/1/mlp/down_proj/kernel") == "('mp', None)"
    assert spec_of(text, "model/layers/0/input_layernorm/weight") == "replicated"
    q = next(line for line in text.splitlines() if line.startswith("model/layers/0/self_attn/q_proj"))
    assert q.split()[1] == "128x128" and q.endswith("32.00 KiB")  # 128*128*4 / 2
    assert "mesh: dp=4, mp=2 (8 devices), 21 params" in text
    assert "total: 1.66 MiB (1739264 bytes)" in text
    assert "per device: 850.50 KiB (870912 bytes), ideal (total / 8): 212.31 KiB, 4.01x ideal" in text


def test_devices_flag_sets_the_simulated_device_count():
    """On the default, scanned model: FSDP and TP split a stack behind its layer axis."""
    out = run_cli("rules", "llama-tiny", "--devices", "16", "--n_model_shards", "4",
                  "--rules", "auto+fsdp")
    assert out.returncode == 0, out.stderr
    assert "mesh: dp=4, mp=4 (16 devices)" in out.stdout
    assert spec_of(out.stdout, "model/layers/0:2/self_attn/q_proj/kernel") == "(None, 'dp', 'mp')"
    assert "1.25x ideal" in out.stdout  # K, V (2 KV heads < 4 shards) split over dp only


def test_plan_table_prints_get_sharding_rules_in_python(workdir, capsys):
    """The table of the unrolled model (``scan_layers=False``), one row per layer's param."""
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=workdir, verbose=False)
    model = load_model("llama-tiny", scan_layers=False)
    rules = deployer.get_sharding_rules(model.params, trace_fn=model.trace_fn)
    rows = {r["path"]: r for r in plan_table(deployer, model.params, rules)}
    assert rows["model/layers/0/self_attn/q_proj/kernel"]["spec"] == COLUMN
    assert rows["model/layers/0/mlp/down_proj/kernel"]["spec"] == ROW
    assert rows["lm_head/kernel"]["bytes_per_device"] == 128 * 256 * 4 // 2
    t = totals(list(rows.values()), 8)
    assert t["bytes"] == 1739264 and t["bytes_per_device"] == 870912
    main(["rules", "llama-tiny", "--json"])  # in-process: jax already has its 8 devices
    printed = json.loads(capsys.readouterr().out)
    assert {r["path"]: r["spec"] for r in printed}["lm_head/kernel"] == str(COLUMN)


def test_module_function_models(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_model.py").write_text(
        "import numpy as np\n"
        "def params():\n"
        "    return {'Dense_0': {'kernel': np.zeros((8, 16), np.float32)},\n"
        "            'Dense_1': {'kernel': np.zeros((16, 8), np.float32)}}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    main(["rules", "my_model:params"])
    out = capsys.readouterr().out
    assert spec_of(out, "Dense_0/kernel") == "(None, 'mp')"
    assert spec_of(out, "Dense_1/kernel") == "('mp', None)"
    with pytest.raises(ValueError, match="Unknown model"):
        load_model("gpt-17")


def test_png(tmp_path, capsys):
    path = str(tmp_path / "plan.png")
    if importlib.util.find_spec("matplotlib") is None:
        with pytest.raises(SystemExit, match="needs matplotlib.*pip install matplotlib"):
            main(["rules", "llama-tiny", "--png", path])
    else:
        main(["rules", "llama-tiny", "--png", path])
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_llama_models_without_the_zoo_say_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "redco_zoo_models", None)  # makes the import fail
    for name in ("llama-tiny", "llama-7b"):
        with pytest.raises(ImportError, match=r"pip install redco-zoo-models"):
            load_model(name)
    (tmp_path / "zoo_free.py").write_text(
        "import numpy as np\ndef params():\n    return {'w': np.zeros((8, 16), np.float32)}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_model("zoo_free:params").params["w"].shape == (8, 16)  # the zoo is optional


def test_plan_argument_errors_name_flags_by_their_shown_spelling(capsys):
    """One-line argument errors of ``redco plan`` (exit 2) name a mistyped flag's shown
    spelling and a missing required flag by it alone, never by its old dashed alias."""
    def error_line(*argv) -> str:
        with pytest.raises(SystemExit) as stop:
            main(list(argv))
        lines = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 2 and len(lines) == 1, lines
        return lines[0]
    assert error_line("plan", "--model", "m", "--devices", "8", "--device_memory", "1GB",
                      "--lora-rnak", "8").endswith("(did you mean --lora_rank?)")
    assert error_line("plan", "--model", "m", "--devices", "8").endswith(
        "the following arguments are required: --device_memory")


def test_devices_says_it_is_the_whole_mesh_not_n_local_devices():
    """``--devices`` (of both commands) and ``Deployer(n_local_devices=)`` are two concepts (the
    mesh planned for; a per-process cap), and the help of each says which."""
    import argparse

    from redco_planner.commands import PlanCommand, RulesCommand
    for command in (PlanCommand(), RulesCommand()):
        parser = argparse.ArgumentParser()
        command.add_arguments(parser)
        [devices] = [a for a in parser._actions if "--devices" in a.option_strings]
        assert "every process's together" in devices.help and "n_local_devices" in devices.help
    assert "redco plan --devices" in Deployer.__doc__
