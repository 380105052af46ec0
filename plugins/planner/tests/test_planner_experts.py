"""The planner chooses expert parallelism (issue 44 point 4): a tiny Mixture-of-Experts decoder
(``moe_helpers.MOE``: 8 experts, 509 wide, 97% of its params) on 8 simulated devices of 6 MiB
(5.4 usable). Only layouts that split the experts by expert fit: measured with every layout
compiled, ``auto+ep`` peaks at 4.3 MiB at mp=1 (one expert a device) and 5.2 MiB at mp=2; no
other layout without context parallelism is under 14.3 MiB, none with it under 7.8 MiB (TP
cannot split a 509-wide expert; FSDP splits it, but gathers each layer's experts and runs them
on the single-device path, whose ``ragged_dot`` XLA:CPU lowers through every expert).
``Deployer(n_model_shards="auto")`` picks ``auto+ep`` at mp=1 with no EP flag, and the step it
trains with sends the tokens to their experts (all_to_all)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from moe_helpers import moe_loss, moe_model
from planner_helpers import lm_examples

BUDGET = 6 * 2**20


def test_only_expert_parallelism_fits_and_the_pick_trains(workdir):
    from redco import Deployer, Trainer
    from redco_zoo_lm import collate_fn, loss_fn
    apply_fn, params = moe_model()
    before = jax.device_get(params)
    deployer = Deployer(jax_seed=0, n_model_shards="auto", device_memory=BUDGET,
                        workdir=workdir, verbose=False)
    trainer = Trainer(deployer, collate_fn, apply_fn, loss_fn, params, optax.adamw(1e-2),
                      remat="none")
    examples = lm_examples(16)
    trainer.fit(examples, per_device_batch_size=1, n_epochs=1)

    plan = deployer.layout_plan
    assert (plan.n_model_shards, plan.sharding_rules, plan.n_expert_shards) == (1, "auto+ep", 8)
    assert "experts split over ep=8 devices (auto+ep), as auto did not fit" in plan.reason
    assert [t.sharding_rules for t in plan.tried] == ["auto", "auto+ep"]
    assert plan.tried[-1].collectives["all-to-all"]["ops"] == 8  # 2 MoE layers x 2 x (fwd, bwd)
    experts = trainer.params["model"]["layers"][0]["mlp"]["experts"]
    assert experts["gate_proj"].sharding.spec == P("dp")
    assert experts["gate_proj"].addressable_shards[0].data.shape == (1, 32, 509)  # one expert
    assert "all-to-all" in trainer.compile_train_step(examples, 1).as_text()
    after = jax.device_get(trainer.params)
    assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(after))
    gate = lambda p: p["model"]["layers"][0]["mlp"]["experts"]["gate_proj"]  # noqa: E731
    assert not np.allclose(gate(after), gate(before))


def test_without_expert_parallelism_nothing_fits():
    from redco_planner.planner import PlanError, plan
    apply_fn, params = moe_model()
    batch = {"input_ids": jax.ShapeDtypeStruct((1, 17), jnp.int32)}
    with pytest.raises(PlanError, match="smallest per-device peak found is 14"):
        plan(params, moe_loss(apply_fn), batch, 8, BUDGET, expert_parallel=False)
