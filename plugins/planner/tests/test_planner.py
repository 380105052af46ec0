"""The planner: ahead-of-time compiled train steps on abstract shapes pick the layout."""
import jax
import pytest

from redco_planner.inspection import load_model, parse_bytes
from redco_planner.layouts import HEADROOM, usable_bytes
from redco_planner.measure import measure
from redco_planner.planner import PlanError, plan

SEQ_LEN = 32


@pytest.fixture(scope="module")
def tiny():
    return load_model("llama-tiny", seq_len=SEQ_LEN)


def test_budget_that_needs_model_parallelism_picks_two_shards(tiny):
    batch = tiny.batch(1)
    data_parallel = [measure(tiny.params, tiny.loss_fn, batch, 8, 1, name)
                     for name in ("auto", "auto+fsdp")]
    # the largest budget whose usable bytes (HEADROOM kept free) are under both mp=1 peaks (it
    # was the smaller peak - 1 when a layout fitted to the last byte)
    smallest = min(layout.peak_bytes for layout in data_parallel)
    budget = int(smallest / (1 - HEADROOM)) + 2
    while usable_bytes(budget) >= smallest:
        budget -= 1
    result = plan(tiny.params, tiny.loss_fn, batch, n_devices=8, device_memory_bytes=budget)
    assert result.n_model_shards == 2
    assert result.sharding_rules in ("auto", "auto+fsdp")
    assert result.peak_bytes <= usable_bytes(budget) < budget
    assert [(t.n_model_shards, t.fits) for t in result.tried][:2] == [(1, False), (1, False)]
    assert result.tried[-1].fits and result.tried[-1].n_model_shards == 2
    assert any("q_proj" in pattern for pattern, _ in result.rules)
    assert result.deployer_kwargs() == {"n_model_shards": 2, "n_context_shards": 1,
                                        "sharding_rules": result.sharding_rules}
    assert "pick: n_model_shards=2" in str(result)


def test_measured_peak_counts_params_grads_and_adam_state(tiny):
    layout = measure(tiny.params, tiny.loss_fn, tiny.batch(1), 8, 1, "auto")
    n_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tiny.params))
    assert layout.params_bytes == n_bytes  # replicated over 8 devices
    assert layout.peak_bytes >= 4 * n_bytes  # params, Adam's mu and nu, grads
    assert layout.alias_bytes >= 3 * n_bytes  # the state is donated, as in Trainer


def test_nothing_fits_names_the_smallest_peak(tiny):
    with pytest.raises(PlanError, match="smallest per-device peak found is") as info:
        plan(tiny.params, tiny.loss_fn, tiny.batch(1), n_devices=8, device_memory_bytes=1000,
             rule_sets=("auto+fsdp",), try_all=True)  # every layout compiled
    smallest = min(t.peak_bytes for t in info.value.tried)
    assert len(info.value.tried) == 4  # mp = 1, 2, 4, 8
    assert f"({smallest} bytes" in str(info.value)


def test_a_layout_whose_state_alone_is_over_budget_is_not_compiled_and_could_not_fit(tiny):
    batch, settings = tiny.batch(1), dict(n_devices=8, rule_sets=("auto",))
    every = plan(tiny.params, tiny.loss_fn, batch, device_memory_bytes=2 ** 40, try_all=True,
                 **settings).tried  # compiled, each one
    replicated = every[0]
    assert (replicated.n_model_shards, replicated.over_budget) == (1, None)
    budget = int(replicated.state_bytes / (1 - HEADROOM)) - 64  # mp=1 auto's state is over
    result = plan(tiny.params, tiny.loss_fn, batch, device_memory_bytes=budget, **settings)
    skipped = [t for t in result.tried if t.over_budget is not None]
    assert skipped and skipped[0].n_model_shards == 1, [t.describe() for t in result.tried]
    assert all(t.compile_s == 0 and t.peak_bytes is None and not t.fits for t in skipped)
    assert "params and optimizer state alone are" in skipped[0].describe()
    # the bound is sound: compiled, each skipped layout peaks at least its state, over budget
    for t in skipped:
        compiled = next(c for c in every if c.n_model_shards == t.n_model_shards)
        assert compiled.state_bytes == t.state_bytes <= compiled.argument_bytes
        assert compiled.peak_bytes > usable_bytes(budget), t.describe()
    fitting = [c for c in every if c.peak_bytes <= usable_bytes(budget)]
    assert (result.n_model_shards, result.peak_bytes) == (fitting[0].n_model_shards,
                                                          fitting[0].peak_bytes)


def test_a_model_too_big_for_any_layout_says_so_without_compiling(tiny):
    with pytest.raises(PlanError, match="params and optimizer state alone need at least") as info:
        plan(tiny.params, tiny.loss_fn, tiny.batch(1), n_devices=8, device_memory_bytes=1000,
             rule_sets=("auto+fsdp",))
    assert len(info.value.tried) == 4 and all(t.compile_s == 0 for t in info.value.tried)


def test_trace_fn_instead_of_a_loss(tiny):
    result = plan(tiny.params, tiny.trace_fn, None, n_devices=8, device_memory_bytes=2 ** 40)
    assert (result.n_model_shards, result.sharding_rules) == (1, "auto")


def test_bad_inputs_are_refused(tiny):
    with pytest.raises(ValueError, match="Unknown rule sets"):
        plan(tiny.params, tiny.loss_fn, tiny.batch(1), 8, 2 ** 30, rule_sets=("nope",))
    with pytest.raises(ValueError, match="xla_force_host_platform_device_count=64"):
        measure(tiny.params, tiny.loss_fn, tiny.batch(1), 64, 1)


def test_usable_bytes_keep_the_headroom_free():
    assert usable_bytes(10 ** 9) == 900_000_000  # HEADROOM = 0.1
    assert usable_bytes(10 ** 9, headroom=0.0) == 10 ** 9
    with pytest.raises(ValueError, match="must be in"):
        usable_bytes(10 ** 9, headroom=1.0)


def test_parse_bytes():
    assert parse_bytes("40GB") == parse_bytes("40GiB") == 40 * 2 ** 30
    assert parse_bytes("512MB") == 512 * 2 ** 20 and parse_bytes("4e9") == 4 * 10 ** 9
    with pytest.raises(ValueError, match="Cannot read"):
        parse_bytes("lots")


def test_plan_cli_reports_each_layout_and_the_pick(capsys):
    from redco.cli import main
    main(["plan", "--model", "llama-tiny", "--devices", "8", "--device-memory", "1GB",
          "--seq-len", "16"])
    out = capsys.readouterr().out
    assert "mp=1   dp=8   auto       peak" in out and "fits" in out
    assert "pick: n_model_shards=1, n_context_shards=1, sharding_rules='auto'" in out
    with pytest.raises(SystemExit, match="params and optimizer state alone need at least"):
        main(["plan", "--model", "llama-tiny", "--devices", "8", "--device-memory", "1KB",
              "--seq-len", "16", "--rules", "auto+fsdp"])


def test_n_model_shards_auto_picks_the_layout_on_the_first_batch(workdir, fit_auto):
    roomy, _ = fit_auto(f"{workdir}/roomy", "1TB")
    assert (roomy.n_model_shards, roomy.layout_plan.sharding_rules) == (1, "auto")
    with open(f"{workdir}/roomy/log.txt") as f:
        log = f.read()
    assert "mp=1   dp=8   auto       peak" in log  # each layout logged through deployer.log_info
    budget = roomy.layout_plan.peak_bytes - 1  # an int, not a string
    tight, trainer = fit_auto(f"{workdir}/tight", budget, remat="none")  # a layout, not remat
    picked = (tight.n_model_shards, tight.layout_plan.sharding_rules)
    assert picked != (1, "auto") and tight.layout_plan.peak_bytes <= usable_bytes(budget)
    assert tight.layout_plan.device_memory_bytes == budget
    assert dict(tight.mesh.shape) == {"dp": 8 // tight.n_model_shards, "mp": tight.n_model_shards}
    specs = {str(s.spec) for s in jax.tree.leaves(trainer.state_shardings.params)}
    assert any("mp" in spec or "dp" in spec for spec in specs)  # laid out as planned
    assert trainer.step == 32 // tight.dp_size


def test_auto_without_device_memory_on_cpu_says_to_pass_it(workdir, fit_auto):
    with pytest.raises(ValueError, match=r"cpu devices do not report it: pass "
                                         r"Deployer\(device_memory='40GB'\)"):
        fit_auto(workdir, None, n_examples=8)


def test_device_memory_given_or_read_off_the_device(workdir):
    from redco import Deployer
    from redco_planner.planner import device_memory_bytes
    deployer = Deployer(jax_seed=0, n_model_shards="auto", device_memory="2GB", workdir=workdir,
                        verbose=False)
    assert device_memory_bytes(deployer) == 2 * 2 ** 30
    deployer.device_memory = 12345
    assert device_memory_bytes(deployer) == 12345

    class Reporting:  # what a GPU reports; jax's CPU devices report nothing
        platform = "gpu"

        def memory_stats(self):
            return {"bytes_limit": 80 * 2 ** 30, "bytes_in_use": 0}

    deployer.device_memory, deployer.devices = None, [Reporting()] + deployer.devices[1:]
    assert device_memory_bytes(deployer) == 80 * 2 ** 30
