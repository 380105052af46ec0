"""``Deployer(wandb_init_kwargs=...)`` (Redco 0.4.x's switch) sends every metric to a Weights &
Biases run: offline here (``mode="offline"``), so the run file it writes under the workdir is
read back record by record and compared with the ``jsonl`` logger's ``metrics.jsonl``."""
import glob
import json
import os
import time

import jax.numpy as jnp
import numpy as np
import optax
from wandb.proto import wandb_internal_pb2

from redco import Deployer, Trainer

BLOCK = 32768  # the run file is a log of records in 32 KiB blocks, after a 7-byte header


def run_records(path):
    """The ``Record`` protobufs of an offline run file, in order."""
    data = open(path, "rb").read()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a record header is padding
            pos += BLOCK - pos % BLOCK
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def history(path):
    rows = []
    for record in run_records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def wait_for_exit_record(path: str, timeout_s: float = 60.0) -> None:
    """Until the run file holds the run's ``exit`` record, its last: W&B's service process
    writes the file, and ``run.finish()`` may return before it has written every record (a CI
    run read this file with no history in it)."""
    deadline = time.monotonic() + timeout_s
    while not any(r.WhichOneof("record_type") == "exit" for r in run_records(path)):
        assert time.monotonic() < deadline, (
            f"W&B's service did not write the exit record to {path} within {timeout_s:.0f} s "
            f"of run.finish(); records so far: {[r.WhichOneof('record_type') for r in run_records(path)]}")
        time.sleep(0.05)  # polls the file's state; the deadline above bounds the wait


def test_metrics_reach_an_offline_wandb_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    workdir = str(tmp_path / "workdir")
    deployer = Deployer(jax_seed=0, workdir=workdir, verbose=False,
                        wandb_init_kwargs={"project": "redco-test", "mode": "offline"})
    rng = np.random.default_rng(0)
    examples = [{"x": x, "y": x.sum()} for x in rng.normal(size=(64, 3)).astype(np.float32)]
    trainer = Trainer(
        deployer=deployer, apply_fn=lambda p, x: x @ p["w"], params={"w": np.zeros(3, np.float32)},
        collate_fn=lambda ex: {"x": np.stack([e["x"] for e in ex]),
                               "y": np.array([e["y"] for e in ex])},
        loss_fn=lambda state, params, batch: jnp.mean(
            (state.apply_fn(params, batch["x"]) - batch["y"]) ** 2),
        optimizer=optax.sgd(0.1))
    trainer.fit(examples, per_device_batch_size=2, n_epochs=2)
    deployer.close()

    runs = glob.glob(os.path.join(workdir, "wandb", "offline-run-*", "run-*.wandb"))
    assert len(runs) == 1, runs
    wait_for_exit_record(runs[0])
    logged = [row for row in history(runs[0]) if "train/loss" in row]
    jsonl = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    assert [row["_step"] for row in logged] == [row["step"] for row in jsonl] == list(range(1, 9))
    assert [row["train/loss"] for row in logged] == [row["train/loss"] for row in jsonl]
    assert logged[-1]["train/loss"] < logged[0]["train/loss"] / 10
