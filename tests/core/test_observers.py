"""What a run reports about itself: throughput and MFU per update, goodput, profiler traces;
observers per Trainer; plugin state in step checkpoints; their bad inputs."""
import glob
import gzip
import json
import os
import time
import types

import jax
import numpy as np
import optax
import pytest
from helpers import (
    GLOBAL_BATCH,
    Recorder,
    lm_collate,
    lm_examples,
    lm_loss,
    lm_model,
    mlp_apply,
    mlp_collate,
    mlp_examples,
    mlp_init,
    mlp_loss,
)

import redco
from redco import Deployer, Trainer, plugins
from redco.observers.throughput import no_mfu_note, peak_tflops


def rows(workdir) -> list[dict]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def lm_trainer(workdir, **kwargs) -> Trainer:
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=workdir, verbose=False)
    apply_fn, params = lm_model()
    return Trainer(deployer, lm_collate, apply_fn, lm_loss, params, optax.adamw(1e-3), **kwargs)


def test_every_update_logs_its_time_tokens_per_s_and_wall_time(workdir, monkeypatch):
    monkeypatch.delenv("REDCO_PEAK_TFLOPS", raising=False)
    trainer = lm_trainer(workdir)
    trainer.fit(lm_examples(32, seq_len=16), GLOBAL_BATCH // 4, n_epochs=1)
    trainer.deployer.close()
    train = [r for r in rows(workdir) if "train/loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    times = [r["time"] for r in train]
    assert times == sorted(times) and abs(times[-1] - time.time()) < 600
    for r in train:
        assert r["train/tokens"] == GLOBAL_BATCH * 17  # every position of input_ids
        assert r["perf/step_time_s"] > 0
        assert r["perf/examples_per_s"] == pytest.approx(GLOBAL_BATCH / r["perf/step_time_s"])
        assert r["perf/tokens_per_s"] == pytest.approx(GLOBAL_BATCH * 17 / r["perf/step_time_s"])
        assert "perf/mfu" not in r  # a CPU has no peak FLOP/s to measure against


def test_count_tokens_says_what_a_token_is(workdir):
    def non_padding(batch):  # token 0 stands for padding here
        return (batch["input_ids"] != 0).sum()
    examples = lm_examples(16, seq_len=16)
    for e in examples[::2]:
        e["token_ids"] = np.where(np.arange(17) < 5, e["token_ids"], 0)
    trainer = lm_trainer(workdir, count_tokens=non_padding)
    trainer.fit(examples, GLOBAL_BATCH // 4, n_epochs=1)
    order = trainer.deployer.epoch_permutation(len(examples), 0)
    want = [sum(int((examples[j]["token_ids"] != 0).sum()) for j in order[i * 8:(i + 1) * 8])
            for i in range(2)]
    assert [r["train/tokens"] for r in rows(workdir) if "train/loss" in r] == want


def test_mfu_is_the_steps_flops_over_time_and_peak(workdir, monkeypatch):
    monkeypatch.setenv("REDCO_PEAK_TFLOPS", "0.5")  # per device, as on an accelerator
    trainer = lm_trainer(workdir, accumulate_grad_batches=2)
    examples = lm_examples(32, seq_len=16)
    trainer.fit(examples, GLOBAL_BATCH // 4, n_epochs=1)
    flops = trainer.step_flops()  # held to XLA's own count in test_step_flops.py
    n_params = sum(x.size for x in jax.tree.leaves(trainer.params))
    tokens = 2 * GLOBAL_BATCH * 16  # two micro-batches of 8 rows, 16 positions predicted
    assert flops >= 6 * n_params * tokens * 0.9  # the whole update, all devices, both halves
    train = [r for r in rows(workdir) if "train/loss" in r]
    assert len(train) == 2
    for r in train:
        assert r["perf/mfu"] == pytest.approx(flops / r["perf/step_time_s"] / (0.5e12 * 8))


def test_peak_flops_come_from_the_device_kind_or_the_override(monkeypatch):
    monkeypatch.delenv("REDCO_PEAK_TFLOPS", raising=False)
    kind = lambda name: types.SimpleNamespace(device_kind=name)  # noqa: E731
    assert peak_tflops(kind("NVIDIA H100 80GB HBM3")) == 989
    assert peak_tflops(kind("NVIDIA H100 PCIe")) == 756
    assert peak_tflops(kind("NVIDIA A100-SXM4-80GB")) == 312
    assert peak_tflops(kind("NVIDIA L4")) == 121
    assert peak_tflops(kind("NVIDIA L40S")) is None  # not an L4
    assert peak_tflops(kind("TPU v5 lite")) == 197
    assert peak_tflops(kind("TPU v5")) == 459
    assert peak_tflops(kind("cpu")) is None
    monkeypatch.setenv("REDCO_PEAK_TFLOPS", "400")
    assert peak_tflops(kind("NVIDIA L40S")) == 400
    unknown = types.SimpleNamespace(device_kind="NVIDIA L40S", platform="gpu")
    assert no_mfu_note(unknown, None) == ("MFU is not logged: the peak FLOP/s of a 'NVIDIA L40S' "
                                          "is not known to redco. Set REDCO_PEAK_TFLOPS=<peak "
                                          "TFLOP/s of one device> to log it.")
    assert no_mfu_note(unknown, 400.0) is None
    assert no_mfu_note(types.SimpleNamespace(device_kind="cpu", platform="cpu"), None) is None
    monkeypatch.setenv("REDCO_PEAK_TFLOPS", "fast")
    with pytest.raises(ValueError, match=r"REDCO_PEAK_TFLOPS='fast' is not a number"):
        peak_tflops(kind("NVIDIA L40S"))


def slow_collate(examples):
    """The MLP's batch, after real work standing for a slow data pipeline (tokenising, decoding
    images): about 0.1 s of hashing on one core."""
    import hashlib
    digest = b""
    for _ in range(250_000):
        digest = hashlib.sha256(digest).digest()
    return mlp_collate(examples)


def goodput(workdir) -> dict:
    with open(os.path.join(workdir, "goodput.json")) as f:
        return json.load(f)


def test_goodput_shows_a_slow_collate_as_data_wait(workdir):
    deployer = Deployer(jax_seed=0, workdir=workdir, verbose=False)
    trainer = Trainer(deployer, slow_collate, mlp_apply, mlp_loss, mlp_init(), optax.sgd(0.1))
    trainer.fit(mlp_examples(64), 2, n_epochs=1, eval_examples=mlp_examples(8),
                save_last_ckpt=True)
    record = goodput(workdir)
    (run,) = record["runs"]
    assert run["first_step"] == 0 and run["last_step"] == 4 and run["replayed_steps"] == 0
    assert run["data"] > 2 * run["steps"], run  # 4 slow batches against 4 tiny updates
    for phase in ("startup", "compile", "checkpoint", "evaluation"):
        assert run[phase] > 0, phase
    parts = sum(run[k] for k in ("startup", "compile", "data", "steps", "replayed",
                                 "checkpoint", "evaluation", "other"))
    assert parts == pytest.approx(run["wall"], rel=1e-6)
    assert record["total"]["goodput"] == pytest.approx(run["steps"] / run["wall"])
    assert "goodput" in open(os.path.join(workdir, "log.txt")).read()


def trace_steps(workdir) -> list[int]:
    """The ``train_step`` events' step numbers in the Perfetto trace under ``workdir``."""
    (path,) = glob.glob(os.path.join(workdir, "profile", "**", "*.trace.json.gz"), recursive=True)
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    return sorted({int(e["args"]["step_num"]) for e in events if e.get("name") == "train_step"})


def test_profile_steps_trace_the_updates_asked_for(workdir):
    deployer = Deployer(jax_seed=0, workdir=workdir, verbose=False)
    trainer = Trainer(deployer, mlp_collate, mlp_apply, mlp_loss, mlp_init(), optax.sgd(0.1))
    trainer.fit(mlp_examples(64), 2, n_epochs=2, profile_steps=(3, 5))
    steps = trace_steps(workdir)
    # started before update 3's batch, stopped once update 5's metrics were read (update 6 is
    # dispatched by then, so its start may be in)
    assert steps[:3] == [3, 4, 5] and set(steps) <= {3, 4, 5, 6}, steps


def test_the_profile_switch_works_for_a_script_left_unchanged(workdir, monkeypatch):
    monkeypatch.setenv("REDCO_PROFILE_STEPS", "2:2")
    deployer = Deployer(jax_seed=0, workdir=workdir, verbose=False)
    Trainer(deployer, mlp_collate, mlp_apply, mlp_loss, mlp_init(), optax.sgd(0.1)).fit(
        mlp_examples(64), 2, n_epochs=1)
    assert trace_steps(workdir)[0] == 2


@pytest.mark.parametrize("profile_steps, env, message", [  # None: known once the batch is
    ((5, 3), None, r"asks for updates 5 to 3, but this fit runs updates 1 on"),
    ((7, 9), None, r"asks for updates 7 to 9, but this fit runs updates 1 to 8"),
    ((0, 2), None, r"asks for updates 0 to 2, but this fit runs updates 1 on"),
    (5, None, r"fit\(profile_steps=...\) is 5: give two update numbers"),
    (None, "3-4", r"\$REDCO_PROFILE_STEPS is '3-4': give two update numbers"),
    (None, "9:10", r"\$REDCO_PROFILE_STEPS asks for updates 9 to 10, but this fit runs updates 1 "
                   r"to 8"),
])
def test_a_bad_profile_window_is_refused_before_training(workdir, monkeypatch, profile_steps,
                                                        env, message):
    if env:
        monkeypatch.setenv("REDCO_PROFILE_STEPS", env)
    deployer = Deployer(jax_seed=0, workdir=workdir, verbose=False)
    recorder = Recorder()
    trainer = Trainer(deployer, mlp_collate, mlp_apply, mlp_loss, mlp_init(), optax.sgd(0.1),
                      callbacks=[recorder])
    with pytest.raises(ValueError, match=message):
        trainer.fit(mlp_examples(64), 2, n_epochs=2, profile_steps=profile_steps)
    assert trainer.step == 0 and "on_fit_start" not in recorder.calls
    assert (trainer.state is None) == (" to 8" not in message)  # placed only to count updates


def test_profiling_needs_a_workdir():
    deployer = Deployer(jax_seed=0, workdir=None, verbose=False)
    trainer = Trainer(deployer, mlp_collate, mlp_apply, mlp_loss, mlp_init(), optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"workdir=None. Give it a workdir"):
        trainer.fit(mlp_examples(64), 2, n_epochs=1, profile_steps=(1, 2))


class Counter:
    """A user plugin whose count must survive a restart."""

    def __init__(self, key="counter", value=None):
        self.key, self.value, self.count, self.resumed = key, value, 0, None

    @redco.hookimpl
    def on_step_end(self, trainer, step):
        self.count += 1

    @redco.hookimpl
    def state_to_save(self):
        return {self.key: self.count if self.value is None else self.value}

    @redco.hookimpl
    def on_resume(self, state):
        self.resumed = state[self.key]
        self.count = self.resumed


def test_a_plugins_state_is_saved_with_each_step_checkpoint_and_resumed(workdir):
    def trainer(counter):
        deployer = Deployer(jax_seed=0, workdir=workdir, verbose=False)
        return Trainer(deployer, mlp_collate, mlp_apply, mlp_loss, mlp_init(), optax.sgd(0.1),
                       callbacks=[counter])
    first = Counter()
    trainer(first).fit(mlp_examples(64), 2, n_epochs=1, save_every_n_steps=3)
    with open(os.path.join(workdir, "ckpts", "step_4", "meta.json")) as f:  # the epoch's end
        assert json.load(f)["plugins"]["counter"] == 4
    again = Counter()
    trainer(again).fit(mlp_examples(64), 2, n_epochs=2, save_every_n_steps=3)
    assert again.resumed == 4 and again.count == 8  # 4 restored, updates 5 to 8 counted


@pytest.mark.parametrize("second, message", [
    (Counter("counter"), r"Plugins .* both save state under 'counter'.*Rename the key"),
    (Counter("other", value={1, 2}), r"saves 'other' = \{1, 2\} in step checkpoints, which "
                                     r"JSON cannot hold"),
])
def test_bad_plugin_state_is_refused_before_training_and_keeps_the_checkpoints(workdir, second,
                                                                               message):
    deployer = Deployer(jax_seed=0, workdir=workdir, verbose=False)
    Trainer(deployer, mlp_collate, mlp_apply, mlp_loss, mlp_init(), optax.sgd(0.1)).fit(
        mlp_examples(64), 2, n_epochs=1, save_every_n_steps=2)
    ckpts = os.path.join(workdir, "ckpts")
    before = {name: open(os.path.join(ckpts, name, "meta.json")).read()
              for name in os.listdir(ckpts)}
    recorder = Recorder()
    trainer = Trainer(deployer, mlp_collate, mlp_apply, mlp_loss, mlp_init(), optax.sgd(0.1),
                      callbacks=[Counter("counter"), second, recorder])
    with pytest.raises((ValueError, TypeError), match=message):
        trainer.fit(mlp_examples(64), 2, n_epochs=2, save_every_n_steps=2)
    assert "on_step_end" not in recorder.calls
    assert {name: open(os.path.join(ckpts, name, "meta.json")).read()
            for name in os.listdir(ckpts)} == before


def test_two_trainers_never_see_each_others_observers(workdir):
    deployer = Deployer(jax_seed=0, workdir=workdir, verbose=False)
    mine, theirs = Recorder(), Recorder()
    a = Trainer(deployer, mlp_collate, mlp_apply, mlp_loss, mlp_init(), optax.sgd(0.1),
                callbacks=[mine])
    b = Trainer(deployer, mlp_collate, mlp_apply, mlp_loss, mlp_init(), optax.sgd(0.1),
                callbacks=[theirs])
    a.train_epoch(mlp_examples(16), 2, epoch=0)  # 16 examples, 2 on each of 8 devices: 1 update
    assert mine.calls.count("on_step_end") == 1 and theirs.calls == []
    b.train_epoch(mlp_examples(32), 2, epoch=0)
    assert mine.calls.count("on_step_end") == 1 and theirs.calls.count("on_step_end") == 2
    assert a.hooks.observers["throughput"] is not b.hooks.observers["throughput"]


class QuietBar:
    """Replaces the built-in progress bar by registering its name."""
    made = []

    def __init__(self, trainer):
        QuietBar.made.append(trainer)

    @redco.hookimpl
    def on_step_end(self, trainer, step):
        pass


class QuietBarPlugin:
    @redco.hookimpl
    def register_observers(self, register):
        register("progress_bar", QuietBar)


def test_a_plugin_replaces_a_built_in_observer_by_its_name(workdir):
    plugins.pm.register(QuietBarPlugin(), name="quiet-bar")
    try:
        deployer = Deployer(jax_seed=0, workdir=workdir, verbose=False)
        trainer = Trainer(deployer, mlp_collate, mlp_apply, mlp_loss, mlp_init(), optax.sgd(0.1))
    finally:
        plugins.pm.unregister(name="quiet-bar")
    assert isinstance(trainer.hooks.observers["progress_bar"], QuietBar)
    assert QuietBar.made == [trainer]
    assert sorted(trainer.hooks.observers) == ["best_checkpoints", "goodput", "metric_logging",
                                               "profiler", "progress_bar", "throughput"]


class BrokenObserverPlugin:
    @redco.hookimpl
    def register_observers(self, register):
        register("broken", 42)


def test_an_observer_that_cannot_be_made_is_refused_naming_its_plugin(workdir):
    plugins.pm.register(BrokenObserverPlugin(), name="broken-observer")
    try:
        deployer = Deployer(jax_seed=0, workdir=workdir, verbose=False)
        with pytest.warns(UserWarning, match=r"redco plugin 'broken-observer' registers observers "
                                             r"'broken' without __call__ \(a class or factory"):
            trainer = Trainer(deployer, mlp_collate, mlp_apply, mlp_loss, mlp_init(),
                              optax.sgd(0.1))
    finally:
        plugins.pm.unregister(name="broken-observer")
    assert "broken" not in trainer.hooks.observers and "throughput" in trainer.hooks.observers
