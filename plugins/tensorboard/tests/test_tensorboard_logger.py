"""redco-tensorboard: what it logs, tensorboard's own reader reads back (steps and values, over
a resumed run's two event files too); ``Deployer(run_tensorboard=True)`` logs a run's metrics
there; without the plugin, ``run_tensorboard=True`` says what to install."""
import json
import os

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from redco import Deployer, Trainer, hookimpl, plugins
from redco.cli import main
from redco_tensorboard import TensorBoardLogger


def read_scalars(workdir) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(os.path.join(workdir, "tensorboard")).Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_registered_from_its_distribution():
    assert plugins.lookup("loggers", "tensorboard") is TensorBoardLogger
    assert plugins.plugin_sources["tensorboard"].startswith("redco-tensorboard ")


def test_scalars_read_back_with_tensorboard_across_a_resumed_run(tmp_path):
    first = TensorBoardLogger(str(tmp_path))
    for step, loss in [(1, 4.0), (2, 3.0), (3, 2.0), (4, 1.0)]:
        first.log(step, {"train/loss": loss, "train/lr": 1e-3 * step})
    first.log(4, {"eval/loss": 2.5})
    # SIGKILLed here (no close): what was logged is on disk. The rerun resumes from a
    # checkpoint at step 2, in the same second, and logs steps 3 and 4 again.
    assert read_scalars(tmp_path)["eval/loss"] == [(4, 2.5)]
    again = TensorBoardLogger(str(tmp_path))
    for step, loss in [(3, 1.5), (4, 0.5)]:
        again.log(step, {"train/loss": loss, "train/lr": 1e-3 * step})
    again.log(4, {"eval/loss": 1.25})
    again.close()
    assert len(os.listdir(tmp_path / "tensorboard")) == 2
    scalars = read_scalars(tmp_path)  # the rerun's values replace the killed run's
    assert sorted(scalars) == ["eval/loss", "train/loss", "train/lr"]
    assert scalars["train/loss"] == [(1, 4.0), (2, 3.0), (3, 1.5), (4, 0.5)]
    assert scalars["eval/loss"] == [(4, 1.25)]
    assert [s for s, _ in scalars["train/lr"]] == [1, 2, 3, 4]
    np.testing.assert_allclose([v for _, v in scalars["train/lr"]], [1e-3, 2e-3, 3e-3, 4e-3],
                               rtol=1e-6)


def test_run_tensorboard_logs_what_fit_logs(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype(np.float32)
    examples = [{"x": a, "y": a.sum(keepdims=True)} for a in x]

    def loss(rng, state, params, batch, is_training):
        return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)

    collate = lambda rows: {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    deployer = Deployer(jax_seed=0, workdir=str(tmp_path), run_tensorboard=True, verbose=False)
    trainer = Trainer(deployer, collate, lambda p, b: b["x"] @ p["w"], loss,
                      {"w": jnp.zeros((4, 1))}, optax.sgd(0.05))
    trainer.fit(examples, 1, n_epochs=2, eval_examples=examples[:8])
    deployer.close()
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    scalars = read_scalars(tmp_path)
    for tag in ("train/loss", "eval/loss"):
        logged = [(r["step"], r[tag]) for r in records if tag in r]
        assert len(logged) >= 2 and [s for s, _ in scalars[tag]] == [s for s, _ in logged]
        np.testing.assert_allclose([v for _, v in scalars[tag]], [v for _, v in logged], rtol=1e-6)


@pytest.fixture
def plugin_missing():
    """redco-tensorboard unregistered and blocked, as if it were not installed."""
    plugins.pm.set_blocked("tensorboard")
    yield
    plugins.pm.unblock("tensorboard")
    plugins.load_entrypoint_plugins()


def test_without_the_plugin_run_tensorboard_says_what_to_install(plugin_missing, tmp_path):
    with pytest.raises(Exception, match=r"pip install redco-tensorboard"):
        Deployer(jax_seed=0, workdir=str(tmp_path), run_tensorboard=True, verbose=False)
    assert not os.path.exists(tmp_path / "tensorboard")


def test_events_decode_as_tensorboard_protos_and_records_carry_their_crcs(tmp_path):
    from tensorboard.compat.proto import event_pb2, summary_pb2

    from redco_tensorboard.events import crc32c, event, record
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    scalars = event(1.5, 300, scalars={"train/loss": 0.25, "train/lr": -3.0})
    assert event_pb2.Event.FromString(scalars) == event_pb2.Event(
        wall_time=1.5, step=300, summary=summary_pb2.Summary(value=[
            summary_pb2.Summary.Value(tag="train/loss", simple_value=0.25),
            summary_pb2.Summary.Value(tag="train/lr", simple_value=-3.0)]))
    start = event(2.0, 7, session_start=True)
    assert event_pb2.Event.FromString(start) == event_pb2.Event(
        wall_time=2.0, step=7, session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START))
    path = tmp_path / "events.out.tfevents.1.host"
    path.write_bytes(record(event(0.0, 0, file_version="brain.Event:2")) + record(scalars))
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    assert list(RawEventFileLoader(str(path)).Load())[1] == scalars  # framing and CRCs read back


class OneMetricPipeline:
    """A zoo pipeline as a third party writes one: its own Deployer logs a metric."""
    description = "logs x at step 1"

    def add_arguments(self, parser):
        parser.add_argument("--workdir")

    def run(self, args):
        Deployer(jax_seed=0, workdir=args.workdir, verbose=False).log_metrics({"x": 3.0}, 1)


class ZooPlugin:
    @hookimpl
    def register_zoo_pipelines(self, register):
        register("one-metric", OneMetricPipeline())


def test_a_zoo_run_writes_to_every_installed_logger_that_needs_no_setup(tmp_path, capsys):
    """``redco zoo run`` (any pipeline) logs to TensorBoard, csv and jsonl when they are
    installed, not to wandb (an account), ``--loggers`` picks; a Deployer outside keeps jsonl."""
    plugins.pm.register(ZooPlugin(), name="one-metric-test")
    try:
        with pytest.raises(SystemExit):
            main(["zoo", "run", "one-metric", "--help"])
        shown = " ".join(capsys.readouterr().out.split()).split("(default: ")[1].split(":")[0]
        assert set(shown.split(",")) == {"csv", "tensorboard", "jsonl"}  # the plugins env's
        main(["zoo", "run", "one-metric", "--workdir", str(tmp_path / "all")])
        assert read_scalars(tmp_path / "all") == {"x": [(1, 3.0)]}
        assert (tmp_path / "all" / "metrics.csv").exists()
        assert (tmp_path / "all" / "metrics.jsonl").exists()
        assert not (tmp_path / "all" / "wandb").exists()
        main(["zoo", "run", "one-metric", "--workdir", str(tmp_path / "one"), "--loggers", "jsonl"])
        assert sorted(os.listdir(tmp_path / "one")) == ["log.txt", "metrics.jsonl",
                                                        "run_config.json"]  # (what it resolved)
    finally:
        plugins.pm.unregister(name="one-metric-test")
    Deployer(jax_seed=0, workdir=str(tmp_path / "outside"), verbose=False).log_metrics({"x": 1}, 1)
    assert sorted(os.listdir(tmp_path / "outside")) == ["log.txt", "metrics.jsonl"]
