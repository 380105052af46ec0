"""Where a run stands in its data (redco/data_order.py): resume with another batch size, streams
trained for max_steps and resumed where they stood, and fit's refusals of what cannot work."""
import os

import jax
import numpy as np
import optax
import pytest
from helpers import mlp_apply, mlp_init, mlp_loss

import redco
from redco import Deployer, Trainer, permutation
from redco.data_order import position_of
from redco.protocols import UsageError


class Crash(Exception):
    pass


class Seen:
    """A plugin and a collate_fn: the example ids each update trained on, by step."""

    def __init__(self, crash_at=None):
        self.crash_at, self.step, self.ids, self.updates = crash_at, None, {}, 0

    def collate(self, examples):
        if self.step is not None:
            self.ids[self.step] = [int(e["id"]) for e in examples]
        return {"x": np.stack([e["x"] for e in examples]), "y": np.stack([e["y"] for e in examples])}

    @redco.hookimpl
    def on_train_batch_start(self, trainer, step):
        self.step = step

    @redco.hookimpl
    def on_step_end(self, trainer, step, metrics):
        self.updates += 1
        if step == self.crash_at:
            raise Crash(step)

    def in_order(self, up_to=None):
        return [i for step in sorted(self.ids) if up_to is None or step <= up_to
                for i in self.ids[step]]


def examples(n):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    return [{"id": i, "x": x[i], "y": np.sin(x[i].sum(keepdims=True))} for i in range(n)]


def trainer_for(workdir, seen, *more_callbacks):
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=workdir, verbose=False)
    return Trainer(deployer, seen.collate, mlp_apply, mlp_loss, mlp_init(), optax.adam(1e-2),
                   callbacks=[seen, *more_callbacks])


@pytest.mark.parametrize("in_memory", [1 << 20, 10], ids=["array-order", "feistel-order"])
def test_a_resume_with_another_batch_size_continues_at_the_same_example(tmp_path, monkeypatch,
                                                                        in_memory):
    monkeypatch.setattr(permutation, "IN_MEMORY", in_memory)  # 10: the order of a huge corpus
    data = examples(100)  # dp 4: 8 examples per update at 2 per device, 12 at 3
    whole = Seen()
    trainer_for(str(tmp_path / "whole"), whole).fit(data, 2, n_epochs=2)

    first = Seen(crash_at=6)
    with pytest.raises(Crash):  # dies after the checkpoint of step 5: 40 examples in
        trainer_for(str(tmp_path / "run"), first).fit(data, 2, n_epochs=2, save_every_n_steps=5)
    second = Seen()
    resumed = trainer_for(str(tmp_path / "run"), second)
    resumed.fit(data, 3, n_epochs=2, save_every_n_steps=5)

    assert min(second.ids) == 6  # it resumed: its first update is step 6
    epoch0 = first.in_order(up_to=5) + second.in_order(up_to=10)  # 40 + 5 updates of 12
    assert sorted(epoch0) == list(range(100))  # every example once, none repeated or skipped
    assert epoch0[:96] == whole.in_order(up_to=12)  # in the order the whole run saw them
    assert resumed.step == 10 + 100 // 12  # then epoch 1: 8 updates of 12


def test_a_checkpoint_from_before_positions_resumes_where_its_step_says():
    old = {"data": {"n_examples": 64, "examples_per_step": 8, "jax_seed": 0}}
    assert position_of({**old, "step": 10, "epoch": 1}, 64) == {"epoch": 1, "examples": 16}
    assert position_of({**old, "step": 16, "epoch": 1}, 64) == {"epoch": 1, "examples": 64}
    assert position_of({**old, "step": 3, "epoch": 0}, 64) == {"epoch": 0, "examples": 24}


def test_max_steps_trains_across_epochs_and_ends_first(workdir):
    data = examples(64)  # 8 updates of 8 per epoch
    seen = Seen()
    trainer = trainer_for(workdir, seen)
    trainer.fit(data, 2, max_steps=20)  # epochs 1, 2 and half of 3
    assert trainer.step == 20 and seen.updates == 20
    assert sorted(seen.in_order(up_to=8)) == sorted(seen.in_order()[64:128]) == list(range(64))
    again = Seen()
    other = trainer_for(workdir + "2", again)
    other.fit(data, 2, n_epochs=2, max_steps=100)  # the epochs end first
    assert other.step == 16


class Counting:
    """A stream of ``data`` in order, round and round, that can tell and restore its position."""

    def __init__(self, data):
        self.data, self.at = data, 0

    def __iter__(self):
        return self

    def __next__(self):
        self.at += 1
        return self.data[(self.at - 1) % len(self.data)]

    def get_state(self):
        return {"at": self.at}

    def set_state(self, state):
        self.at = state["at"]


def test_a_stream_trains_for_max_steps_and_resumes_where_it_stood(tmp_path):
    data = examples(40)  # 8 per update: 12 updates read 96, round the data twice and more
    whole = Seen()
    uninterrupted = trainer_for(str(tmp_path / "whole"), whole)
    uninterrupted.fit(Counting(data), 2, max_steps=12)
    assert whole.in_order() == [i % 40 for i in range(96)]

    first = Seen(crash_at=7)
    with pytest.raises(Crash):  # dies after the checkpoint of step 6
        trainer_for(str(tmp_path / "run"), first).fit(Counting(data), 2, max_steps=12,
                                                      save_every_n_steps=3)
    assert os.listdir(tmp_path / "run" / "ckpts") == ["step_6"]
    second = Seen()
    resumed = trainer_for(str(tmp_path / "run"), second)
    resumed.fit(Counting(data), 2, max_steps=12, save_every_n_steps=3)
    assert second.updates == 6 and min(second.ids) == 7  # it resumed, at step 7
    assert second.in_order() == whole.in_order()[48:]  # with the examples after the 48th
    for a, b in zip(jax.tree.leaves(jax.device_get(resumed.params)),
                    jax.tree.leaves(jax.device_get(uninterrupted.params))):
        np.testing.assert_array_equal(a, b)


def test_a_stream_that_ends_early_ends_training(workdir):
    seen = Seen()
    trainer = trainer_for(workdir, seen)
    trainer.fit(iter(examples(44)), 2, max_steps=100)  # 5 full updates of 8, then 4 left
    assert trainer.step == 5 and seen.in_order() == list(range(40))


@pytest.mark.parametrize("data, kwargs, message", [
    (examples(16), {}, r"Say how long to train: fit\(\.\.\., n_epochs=N\)"),
    (iter(examples(16)), {"n_epochs": 1}, r"is a stream .* max_steps=N\) and no n_epochs"),
    (iter(examples(16)), {"max_steps": 2, "save_every_n_steps": 1},
     r"iterator without get_state\(\) and set_state\(\)"),
    (examples(16), {"max_steps": 0}, r"max_steps=0: use an integer >= 1"),
])
def test_fit_refuses_a_length_it_cannot_train_for_before_training(workdir, data, kwargs,
                                                                    message):
    seen = Seen()
    trainer = trainer_for(workdir, seen)
    with pytest.raises((UsageError, ValueError), match=message):
        trainer.fit(data, 2, **kwargs)
    assert trainer.step == 0 and not seen.ids


class EvalSteps:
    """A plugin: the steps evaluated after, and a stop asked after the ``stop_after``-th."""

    def __init__(self, stop_after=None):
        self.steps, self.stop_after = [], stop_after

    @redco.hookimpl
    def on_eval_end(self, trainer, epoch, metrics):
        self.steps.append(trainer.step)
        if len(self.steps) == self.stop_after:
            trainer.request_stop("enough")


def test_a_stream_is_evaluated_every_n_steps_and_can_stop_there(workdir):
    data = examples(40)
    evals = EvalSteps()
    trainer = trainer_for(workdir, Seen(), evals)
    trainer.fit(Counting(data), 2, max_steps=10, eval_examples=data[:8], eval_every_n_steps=4,
                eval_sanity_check=False)
    assert evals.steps == [4, 8, 10]  # and after the last update
    assert {"eval_results_step4.json", "eval_results_step8.json"} <= set(os.listdir(workdir))

    stopping = EvalSteps(stop_after=1)
    other = trainer_for(workdir + "2", Seen(), stopping)
    other.fit(examples(64), 2, n_epochs=2, eval_examples=data[:8], eval_every_n_steps=3,
              eval_sanity_check=False)  # 8 updates an epoch
    assert other.step == 3 and stopping.steps == [3]  # stopped right after the first
    stopping.stop_after = None  # a later fit is not stopped by the earlier fit's request
    other.fit(examples(64), 2, n_epochs=2, eval_examples=data[:8], eval_sanity_check=False)
    assert other.step == 3 + 16, other.step


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 1000, 4097, 65539])
def test_a_feistel_order_shuffles_every_example_once_by_slices(n):
    """The order of a corpus above ``IN_MEMORY`` rows: a bijection of ``[0, n)``, the same by
    slices as whole, fixed by the seed and the epoch, other for another epoch, and shuffled
    (no position keeps a neighbourhood: positions and examples uncorrelated)."""
    order = permutation.FeistelOrder(n, seed=7, epoch=0)
    whole = order[:]
    assert len(order) == n and sorted(whole.tolist()) == list(range(n))
    cut = n // 3
    assert np.concatenate([order[:cut], order[cut:]]).tolist() == whole.tolist()
    assert order[n - 1] == whole[-1] and order[-1] == whole[-1]
    assert permutation.FeistelOrder(n, 7, 0)[:].tolist() == whole.tolist()
    if n >= 64:
        assert permutation.FeistelOrder(n, 7, 1)[:].tolist() != whole.tolist()
        assert permutation.FeistelOrder(n, 8, 0)[:].tolist() != whole.tolist()
        assert abs(np.corrcoef(np.arange(n), whole)[0, 1]) < 0.2
        assert np.mean(np.abs(np.diff(whole))) > n / 5  # neighbours land far apart


def test_a_resume_under_the_other_shuffle_is_refused_naming_it(tmp_path, monkeypatch):
    """Which order a run's examples were shuffled by is saved with its checkpoints: a resume
    that would shuffle them the other way (a redco that changed where the Feistel order
    starts, or a checkpoint from before it) is refused, and the checkpoints stay."""
    data = examples(40)
    monkeypatch.setattr(permutation, "IN_MEMORY", 10)
    trainer_for(str(tmp_path), Seen()).fit(data, 2, n_epochs=1, save_every_n_steps=2)
    saved = sorted(os.listdir(tmp_path / "ckpts"))
    monkeypatch.setattr(permutation, "IN_MEMORY", 100)
    with pytest.raises(ValueError, match=r"Cannot resume from .*: shuffle was feistel, now None"):
        trainer_for(str(tmp_path), Seen()).fit(data, 2, n_epochs=2, save_every_n_steps=2)
    assert sorted(os.listdir(tmp_path / "ckpts")) == saved
