"""The planner tells a layout that does not fit (its measured peak over the budget, or XLA out of
memory compiling it) from one that could not be measured (any other error), and shows the
latter's exception: a bug is not reported as "too big"."""
import jax
import pytest

from redco_planner import search
from redco_planner.inspection import load_model
from redco_planner.layouts import TriedLayout, nothing_fits
from redco_planner.planner import PlanError, plan

BUG = ValueError("a bug in the loss")
OUT_OF_MEMORY = jax.errors.JaxRuntimeError(
    "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2.00GiB.")


@pytest.fixture(scope="module")
def tiny():
    return load_model("llama-tiny", seq_len=32)


def test_an_unrelated_error_could_not_be_measured_and_out_of_memory_does_not_fit(tiny,
                                                                                  monkeypatch):
    """At mp=1 the auto layout raises a bug, auto+fsdp runs XLA out of memory; mp=2 is measured
    for real and picked."""
    real = search.measure

    def measure(params, loss, batch, n_devices, n_model_shards, sharding_rules, *args, **kwargs):
        if n_model_shards == 1:
            raise BUG if sharding_rules == "auto" else OUT_OF_MEMORY
        return real(params, loss, batch, n_devices, n_model_shards, sharding_rules, *args,
                    **kwargs)
    monkeypatch.setattr(search, "measure", measure)  # what the planner's walk measures with
    result = plan(tiny.params, tiny.loss_fn, tiny.batch(1), n_devices=8,
                  device_memory_bytes=2 ** 40)
    bug, oom, picked = result.tried
    assert (bug.error, bug.out_of_memory, bug.fits) == ("ValueError: a bug in the loss", None, False)
    assert oom.error is None and oom.out_of_memory.startswith("JaxRuntimeError: RESOURCE_EXHAUSTED")
    shown = str(result).splitlines()
    assert shown[1] == "  mp=1   dp=8   auto       could not be measured: ValueError: a bug in the loss"
    assert shown[2] == ("  mp=1   dp=8   auto+fsdp  does not fit: XLA ran out of memory compiling it "
                        "(JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to "
                        "allocate 2.00GiB.)")
    assert shown[3].endswith("  fits") and picked.n_model_shards == 2
    assert result.reason.startswith("the smallest mp that fits (nothing measured at mp=1 fits; 1 "
                                    "could not be measured)")


def test_too_big_layouts_do_not_fit_and_say_so(tiny):
    with pytest.raises(PlanError, match="smallest per-device peak found is") as info:
        plan(tiny.params, tiny.loss_fn, tiny.batch(1), n_devices=8, device_memory_bytes=1000,
             rule_sets=("auto",), try_all=True)  # compiled, not skipped for their state alone
    assert all(t.describe().endswith("  does not fit") for t in info.value.tried)
    assert "Not compared" not in str(info.value)


def test_nothing_fits_shows_the_exceptions_of_layouts_not_measured():
    measured = TriedLayout("auto", 1, 8, peak_bytes=5000)
    unmeasured = TriedLayout("auto", 2, 8, error="ValueError: a bug in the loss")
    message = str(nothing_fits([measured, unmeasured], 8, 1000, 0.1))
    assert message.endswith(" Not compared, since not measured: mp=2   dp=4   auto       could "
                            "not be measured: ValueError: a bug in the loss")
    message = str(nothing_fits([unmeasured], 8, 1000, 0.1))
    assert message == ("No layout was found for 8 devices: mp=2   dp=4   auto       could not be "
                       "measured: ValueError: a bug in the loss")
