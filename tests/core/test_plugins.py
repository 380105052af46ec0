"""The plugin system: documented hooks, all exercised, entry-point plugins, broken ones."""
import csv
import importlib.util
import inspect
import json
import os
import subprocess
import sys

import optax
import pytest
from helpers import Recorder, mlp_apply, mlp_collate, mlp_examples, mlp_init, mlp_loss

from redco import Deployer, Trainer, hookspecs, plugins
from redco.cli import main

HOOKS = sorted(name for name, _ in inspect.getmembers(hookspecs, inspect.isfunction)
               if hasattr(getattr(hookspecs, name), "redco_spec"))


def test_every_hook_is_documented():
    assert len(HOOKS) == 24
    for name in HOOKS:
        doc = inspect.getdoc(getattr(hookspecs, name)) or ""
        assert "Called" in doc and "Returns" in doc, f"{name} must say when it is called and " \
                                                     "what it returns"


def test_every_hook_is_exercised_by_a_run(workdir, capsys, monkeypatch):
    called = set()
    undo = plugins.pm.add_hookcall_monitoring(lambda name, impls, kw: called.add(name),
                                              lambda outcome, name, impls, kw: None)
    registry = plugins.registry  # register_* hooks are called per plugin, by the registry
    monkeypatch.setattr(plugins, "registry",
                        lambda kind: called.add(f"register_{kind}") or registry(kind))
    try:
        deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=workdir, verbose=False)
        params = mlp_init()
        recorder = Recorder()
        for _ in range(2):  # the second resumes from the first's checkpoint
            trainer = Trainer(deployer, mlp_collate, mlp_apply, mlp_loss, params, optax.sgd(0.1),
                              params_sharding_rules=deployer.get_sharding_rules(params),
                              callbacks=[recorder])
            trainer.fit(mlp_examples(32), 2, n_epochs=1, eval_examples=mlp_examples(8),
                        save_last_ckpt=True, save_argmin_ckpt_by_metrics=["loss"])
        main(["zoo", "list"])
        own = Trainer(Deployer(jax_seed=0, workdir=workdir + "3", verbose=False), mlp_collate,
                      mlp_apply, mlp_loss, params, optax.sgd(0.1), callbacks=[Recorder()])
        own.prepare(mlp_examples(16), 2)
        with own.run() as run:  # a loop that is not fit: on_run_start, on_run_end
            own.train_epoch(mlp_examples(16), 2, epoch=0)
            run.step_done()
        main(["new", "--list"])
        plugins.registry("environments")  # as `redco zoo run grpo --environment` looks one up
        if importlib.util.find_spec("redco_planner") is None:  # the core env: not installed
            auto = Deployer(jax_seed=0, n_model_shards="auto", device_memory="1GB",
                            workdir=workdir + "2", verbose=False)
            with pytest.raises(ValueError, match=r"No layout planners named 'auto'.*pip install "
                                                 r"redco-planner"):
                Trainer(auto, mlp_collate, mlp_apply, mlp_loss, params, optax.sgd(0.1)).fit(
                    mlp_examples(32), 2, n_epochs=1)
        else:  # a dev venv with every package: look the planner up as n_model_shards="auto" does
            assert plugins.lookup("layout_planners", "auto") is not None
    finally:
        undo()
    # state_to_save is gathered plugin by plugin (to name two that clash), not by a hook call
    assert sorted(called | set(recorder.calls)) == HOOKS
    assert recorder.resumed_state == {"recorder_steps": 4, "best": {"loss": pytest.approx(
        recorder.eval_losses[0])}}
    listed = capsys.readouterr().out
    assert "lm " in listed and "minimal " in listed  # zoo pipelines and templates, by entry point


def test_a_plugin_missing_a_method_is_refused_naming_it(tmp_path, monkeypatch, workdir):
    dist = tmp_path / "redco_halfdone-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: redco-halfdone\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[redco]\nhalfdone = redco_halfdone_mod\n")
    (tmp_path / "redco_halfdone_mod.py").write_text(
        "import redco\n\nclass Half:\n    def save(self, path, tree): pass\n\n"
        "@redco.hookimpl\ndef register_checkpoint_formats(register):\n"
        "    register('half', Half())\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(UserWarning, match=r"redco plugin 'halfdone' registers checkpoint_formats "
                                         r"'half' without load; it is refused"):
        formats = plugins.registry("checkpoint_formats")
    assert "half" not in formats and "orbax" in formats
    with pytest.raises(ValueError, match=r"No checkpoint formats named 'half' \(redco plugin "
                                         r"'halfdone' registers checkpoint_formats 'half' without "
                                         r"load\)"):
        Deployer(jax_seed=0, workdir=workdir, checkpoint_format="half", verbose=False)
    plugins.pm.unregister(name="halfdone")


def test_lifecycle_hooks_run_in_order(workdir):
    deployer = Deployer(jax_seed=0, workdir=workdir, verbose=False)
    recorder = Recorder()
    trainer = Trainer(deployer, mlp_collate, mlp_apply, mlp_loss, mlp_init(), optax.sgd(0.1),
                      callbacks=[recorder])
    trainer.fit(mlp_examples(32), 2, n_epochs=1, eval_examples=mlp_examples(8),
                save_last_ckpt=True)
    assert recorder.calls == ["state_to_save", "on_fit_start", "on_step_end", "on_step_end",
                              "on_eval_end", "state_to_save", "on_checkpoint_saved", "on_fit_end"]
    assert recorder not in plugins.pm.get_plugins()  # per-run callbacks leave with the run


def test_installed_third_party_plugin_is_listed_and_used(workdir):
    rows = {row["name"]: row for row in plugins.list_plugins()}
    assert rows["csv_logger"]["source"].startswith("redco-csv-logger")
    assert rows["csv_logger"]["hooks"] == ["register_loggers"]
    deployer = Deployer(jax_seed=0, workdir=workdir, loggers=["jsonl", "csv"], verbose=False)
    Trainer(deployer, mlp_collate, mlp_apply, mlp_loss, mlp_init(), optax.sgd(0.1)).fit(
        mlp_examples(32), 4, n_epochs=1)
    deployer.close()
    with open(os.path.join(workdir, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows if r["metric"] == "train/loss"] == ["1"]


def test_broken_plugin_warns_and_is_skipped(tmp_path, monkeypatch, workdir):
    dist = tmp_path / "redco_broken-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: redco-broken\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[redco]\nbroken = redco_broken_mod\n")
    (tmp_path / "redco_broken_mod.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(UserWarning, match=r"redco plugin 'broken' from redco-broken failed to "
                                         r"load and is skipped: RuntimeError: boom"):
        Deployer(jax_seed=0, workdir=workdir, verbose=False)  # still works
    assert not plugins.pm.has_plugin("broken")


@pytest.mark.parametrize("env", [{"REDCO_PLUGINS": "something_else"},
                                 {"REDCO_DISABLE_PLUGIN_AUTOLOAD": "1"}, {}])
def test_allowlist_and_autoload_switch(env):
    out = subprocess.run([sys.executable, "-m", "redco.cli", "plugins", "--json"],
                         env={**os.environ, **env}, capture_output=True, text=True, check=True)
    names = {row["name"] for row in json.loads(out.stdout)}
    assert {"rules", "local", "ip", "orbax", "jsonl", "templates"} <= names  # always loaded
    assert ("csv_logger" in names) == (not env)


TOY_LAUNCHER = '''
import os
import subprocess

import redco
from redco.protocols import Launcher


class Toy(Launcher):
    """Runs the command N times here, each with TOY_RANK set."""
    description = "run the command --copies times on this machine"

    def add_arguments(self, group):
        group.add_argument("--copies", type=int, default=1)

    def submit(self, command, args):
        codes = [subprocess.run(command, env={**os.environ, "TOY_RANK": str(i)}).returncode
                 for i in range(args.copies)]
        return max(codes)


@redco.hookimpl
def register_launchers(register):
    register("toy", Toy())
'''


def test_a_third_party_launcher_joins_redco_launch(tmp_path, monkeypatch, capsys):
    dist = tmp_path / "redco_toy-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: redco-toy\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[redco]\ntoy = redco_toy_mod\n")
    (tmp_path / "redco_toy_mod.py").write_text(TOY_LAUNCHER)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(SystemExit):
            main(["launch", "--help"])
        shown = capsys.readouterr().out
        assert "--launcher {" in shown and "toy" in shown.split("--launcher {")[1].split("}")[0]
        assert "toy: run the command --copies times" in shown and "--copies" in shown
        out = tmp_path / "ranks.txt"
        with pytest.raises(SystemExit) as ended:
            main(["launch", "--launcher", "toy", "--copies", "3", "--", sys.executable, "-c",
                  f"import os; open({str(out)!r}, 'a').write(os.environ['TOY_RANK'])"])
        assert ended.value.code == 0 and out.read_text() == "012"
    finally:
        plugins.pm.unregister(name="toy")
