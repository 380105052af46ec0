"""The planner's remat lever: policies tried least recompute first at each model-parallel degree,
measured by real ahead-of-time compiles; the Trainer adopts the pick."""
import jax
import jax.numpy as jnp
import optax
import pytest
from planner_helpers import lm_examples, lm_model

import redco
from redco import plugins, remat
from redco_planner.inspection import load_model
from redco_planner.layouts import usable_bytes
from redco_planner.measure import measure
from redco_planner.models import lm_loss
from redco_planner.planner import REMAT_POLICIES, plan

SEQ_LEN = 64


@pytest.fixture(scope="module")
def tiny():
    """Unrolled (``scan_layers=False``): there ``dots_saveable`` keeps less than ``"none"``; a
    scanned stack's ladder is test_trainer_fit_trains_with_the_planned_policy's."""
    return load_model("llama-tiny", seq_len=SEQ_LEN, scan_layers=False)


def test_remat_only_where_no_remat_does_not_fit_and_before_more_shards(tiny):
    batch = tiny.batch(4)
    roomy = plan(tiny.params, tiny.loss_fn, batch, 8, 2 ** 40, rule_sets=("auto",),
                 remat_policies=REMAT_POLICIES)
    assert [(t.n_model_shards, t.remat) for t in roomy.tried] == [(1, "none")]
    assert roomy.remat == "none" and "fits without remat" in roomy.reason
    no_remat_peak = roomy.peak_bytes
    budget = no_remat_peak  # its usable bytes (90%) are below the no-remat peak
    tight = plan(tiny.params, tiny.loss_fn, batch, 8, budget, rule_sets=("auto",),
                 remat_policies=REMAT_POLICIES)
    assert [(t.n_model_shards, t.remat, t.fits) for t in tight.tried] == [
        (1, "none", False), (1, "dots_saveable", True)]
    assert (tight.n_model_shards, tight.remat) == (1, "dots_saveable")
    none, dots = tight.tried
    assert dots.peak_bytes < none.peak_bytes and dots.flops > none.flops  # measured recompute
    assert "at mp=1 auto fits only with remat=dots_saveable (not with none)" in tight.reason
    assert "remat='dots_saveable'" in str(tight) and "why: " in str(tight)
    # mp=2 without remat would fit too: less recompute, but more communication
    assert measure(tiny.params, tiny.loss_fn, batch, 8, 2, "auto").peak_bytes <= usable_bytes(budget)


def test_a_loss_without_remat_layers_compiles_once_per_layout():
    params = {"w": jnp.zeros((16, 16))}

    def loss(p, batch):
        return jnp.mean(jnp.tanh(batch["x"] @ p["w"]) ** 2)
    batch = {"x": jax.ShapeDtypeStruct((2, 16), jnp.float32)}
    result = plan(params, loss, batch, 8, 2 ** 30, rule_sets=("auto",),
                  remat_policies=REMAT_POLICIES)
    assert [t.remat for t in result.tried] == ["none"] and result.remat == "none"
    with pytest.raises(ValueError, match="Unknown remat policy 'some'"):
        plan(params, loss, batch, 8, 2 ** 30, remat_policies=("none", "some"))


def fit_auto(workdir, memory, remat_policy=None):
    """One epoch of the zoo LM at 64 tokens x 2 rows per device under n_model_shards="auto"."""
    from redco import Deployer, Trainer
    from redco_zoo_lm import collate_fn, loss_fn
    apply_fn, params = lm_model()
    deployer = Deployer(jax_seed=0, n_model_shards="auto", device_memory=memory, workdir=workdir,
                        verbose=False)
    trainer = Trainer(deployer, collate_fn, apply_fn, loss_fn, params, optax.adamw(1e-2),
                      remat=remat_policy)
    trainer.fit(lm_examples(16, seq_len=SEQ_LEN - 1), per_device_batch_size=2, n_epochs=1)
    return deployer, trainer


def test_trainer_fit_trains_with_the_planned_policy(workdir):
    """The zoo LM's layers scanned (the default): ``"none"`` there keeps what
    ``dots_with_no_batch_dims_saveable`` keeps, so ``dots_saveable`` (more kept) is not tried,
    and ``full`` is the pick at mp=1 where ``"none"`` does not fit."""
    apply_fn, params = lm_model()
    batch = {"input_ids": jax.ShapeDtypeStruct((2, SEQ_LEN), jnp.int32)}
    no_remat_peak = measure(params, lm_loss(apply_fn), batch, 8, 1, "auto").peak_bytes
    layers = remat.layers_traced()
    deployer, trainer = fit_auto(workdir, no_remat_peak)
    assert [(t.n_model_shards, t.remat) for t in deployer.layout_plan.tried] == [
        (1, "none"), (1, "full")]
    assert (deployer.n_model_shards, deployer.layout.remat) == (1, "full")
    assert trainer.remat == "full"
    assert remat.layers_traced() > layers  # the train step was traced with remat layers
    assert trainer.step == 1
    with open(f"{workdir}/log.txt") as f:
        assert "remat='full'" in f.read()


def test_an_explicit_trainer_remat_is_kept_and_planned_with(workdir):
    deployer, trainer = fit_auto(workdir, "1TB", remat_policy="full")
    assert trainer.remat == "full" and deployer.layout.remat == "full"
    assert [t.remat for t in deployer.layout_plan.tried] == ["full"]


class OldPlanner:
    """A third-party planner written before remat: ``plan`` takes no ``remat``, and its
    ``Layout`` has three fields."""
    calls = 0

    def plan(self, deployer, params, loss, batch, optimizer, rule_sets):
        from redco.protocols import Layout
        OldPlanner.calls += 1
        return Layout(1, "auto", [])


class OldPlannerPlugin:
    @redco.hookimpl(tryfirst=True)
    def register_layout_planners(self, register):
        register("auto", OldPlanner())


def test_a_planner_without_remat_still_works(workdir):
    plugin = OldPlannerPlugin()
    plugins.pm.register(plugin)
    try:
        deployer, trainer = fit_auto(workdir, "1TB")
    finally:
        plugins.pm.unregister(plugin)
    assert OldPlanner.calls == 1
    assert deployer.layout.remat == "none" and trainer.remat == "none" and trainer.step == 1
