"""``Deployer.get_lr_schedule_fn``'s values against the formulas written out here
(``redco/lr_schedule.py``): a linear warmup from ``init`` to the peak over ``W`` updates, then
over the ``D = N - 1 - W`` updates to the run's last (update ``N - 1``):

* linear: ``peak + (end - peak) * t / D``;
* cosine: ``end + (peak - end) * (1 + cos(pi * t / D)) / 2``;

``t`` counted from the warmup's end, and ``end`` from update ``N - 1`` on. Checked a quarter
into the decay too, where the two differ most plainly (at its midpoint both are halfway)."""
import math

import jax
import numpy as np
import pytest

from redco import Deployer

PEAK, INIT, END = 3e-3, 1e-4, 2e-4


def expected(count: int, n: int, warmup: int, kind: str) -> float:
    """The schedule's value at update ``count`` of ``n``, written out (module docstring)."""
    decay = n - 1 - warmup
    if count >= n - 1:
        return END
    if count < warmup:
        return INIT + (PEAK - INIT) * count / warmup
    t = count - warmup
    if kind == "linear":
        return PEAK + (END - PEAK) * t / decay
    return END + (PEAK - END) * (1 + math.cos(math.pi * t / decay)) / 2


def values(kind: str, n_values: int, **args) -> np.ndarray:
    """The schedule's values at updates 0 .. n_values - 1, computed as the step does (jitted)."""
    deployer = Deployer(jax_seed=0, n_model_shards=2, verbose=False)  # dp 4
    schedule = deployer.get_lr_schedule_fn(learning_rate=PEAK, schedule_type=kind,
                                           init_learning_rate=INIT, end_learning_rate=END,
                                           **args)
    return np.asarray(jax.jit(jax.vmap(schedule))(np.arange(n_values)))


@pytest.mark.parametrize("kind", ["linear", "cosine"])
@pytest.mark.parametrize("n, warmup, args", [
    # 5 epochs of 64 // (2 a device x dp 4) = 8 updates: 40, 12% of them (4.8: 4) warming up
    (40, 4, dict(train_size=64, per_device_batch_size=2, n_epochs=5, warmup_rate=0.12)),
    # max_steps: 21 updates whatever the data, 5 of them warming up
    (21, 5, dict(train_size=7, per_device_batch_size=1, n_epochs=3, warmup_steps=5,
                 max_steps=21))])
def test_warmup_then_decay_are_the_formulas(kind, n, warmup, args):
    got = values(kind, n + 3, **args)
    want = np.array([expected(c, n, warmup, kind) for c in range(n + 3)], np.float32)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=0)
    assert (got[n - 1:] == np.float32(END)).all()  # exactly, from the last update on
    quarter = warmup + (n - 1 - warmup) // 4  # a quarter into the decay
    other = expected(quarter, n, warmup, "cosine" if kind == "linear" else "linear")
    assert abs(got[quarter] - other) > 0.05 * PEAK, (got[quarter], other)


@pytest.mark.parametrize("args, named", [
    ({"warmup_steps": 2.5}, "warmup_steps=2.5: use an integer >= 0 (or None)"),
    ({"warmup_rate": "0.1"}, "warmup_rate='0.1': use a number from 0 to 1"),
    ({"warmup_rate": float("nan")}, "warmup_rate=nan: use a number from 0 to 1"),
    ({"init_learning_rate": -1e-4}, "init_learning_rate=-0.0001: use a number >= 0"),
    ({"schedule_type": "cos"}, "schedule_type='cos': use 'linear' or 'cosine'")])
def test_a_bad_warmup_or_schedule_is_refused_naming_it(args, named):
    deployer = Deployer(jax_seed=0, n_model_shards=2, verbose=False)
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        deployer.get_lr_schedule_fn(**{"train_size": 64, "per_device_batch_size": 2,
                                       "n_epochs": 1, "learning_rate": 1e-3, **args})


@pytest.mark.parametrize("args, named", [
    ({"warmup_steps": 4, "max_steps": 5}, "warmup_steps=4 in a run of 5 updates"),
    ({"warmup_steps": 9, "max_steps": 5}, "warmup_steps=9 in a run of 5 updates"),
    ({"warmup_rate": 1.0}, r"warmup_rate=1.0 \(8 updates\) in a run of 8 updates"),
    ({"warmup_rate": 0.9}, r"warmup_rate=0.9 \(7 updates\) in a run of 8 updates")])
def test_a_warmup_that_does_not_end_before_the_last_update_is_refused(args, named):
    """It would end the run below its peak, or at the peak instead of the end value."""
    deployer = Deployer(jax_seed=0, n_model_shards=2, verbose=False)  # 64 // (2 x dp 4): 8
    with pytest.raises(ValueError, match=named + r": the warmup must end before the run's last "
                                                 r"update.*Give fewer than \d+ warmup updates"):
        deployer.get_lr_schedule_fn(**{"train_size": 64, "per_device_batch_size": 2,
                                       "n_epochs": 1, "learning_rate": 1e-3, **args})
    ok = {**args, **({"warmup_steps": 3} if "warmup_steps" in args else {"warmup_rate": 0.75})}
    deployer.get_lr_schedule_fn(**{"train_size": 64, "per_device_batch_size": 2, "n_epochs": 1,
                                   "learning_rate": 1e-3, **ok})  # 3 (or 6) of 5 (or 8): fine
