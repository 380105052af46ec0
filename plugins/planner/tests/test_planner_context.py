"""The planner chooses the context-parallel degree: layouts are tried by devices per example
(mp x cp), tensor before context parallelism at the same number, and a sequence too long for
any unsplit layout gets the smallest cp that fits; ``Deployer(n_model_shards="auto")`` trains
with that pick exactly as with the same layout given by hand; a model whose attention cannot
split the sequence is planned without it."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from planner_helpers import lm_examples, one_head_lm

from redco_planner.planner import PlanError, plan, split_degrees

SEQ_LEN = 512
# ``one_head_lm`` at this length fits BUDGET only with its sequence split. Measured peaks per
# device (MiB, auto+fsdp): mp1 7.9, mp2 7.4, mp4 7.1, mp8 6.9; cp2 4.4.
BUDGET = 6 * 2**20  # usable 5.4 MiB with the 10% headroom


def test_layouts_go_by_devices_per_example_tensor_parallelism_first():
    assert split_degrees(8, None, None) == [(1, 1), (2, 1), (1, 2), (4, 1), (2, 2), (1, 4),
                                            (8, 1), (4, 2), (2, 4), (1, 8)]
    assert split_degrees(8) == [(1, 1), (2, 1), (4, 1), (8, 1)]  # context parallelism off
    assert split_degrees(8, [2], None) == [(2, 1), (2, 2), (2, 4)]
    assert split_degrees(12, None, [1]) == [(1, 1), (2, 1), (4, 1), (3, 1), (6, 1), (12, 1)]


def test_redco_plan_with_seq_len_picks_context_parallelism_and_says_why(capsys):
    from redco.cli import main
    model = ["plan", "--model", "planner_helpers:one_head_plan_model", "--devices", "8",
             "--device-memory", f"{BUDGET}", "--seq_len", f"{SEQ_LEN}", "--rules", "auto+fsdp"]
    main(model)
    out = capsys.readouterr().out
    tried = re.findall(r"mp=(\d+)\s+(?:cp=(\d+)\s+)?dp=(\d+)\s+auto\+fsdp .*  (fits|does not fit)",
                       out)
    assert tried == [("1", "", "8", "does not fit"), ("2", "", "4", "does not fit"),
                     ("1", "2", "4", "fits")], out
    assert "pick: n_model_shards=1, n_context_shards=2, sharding_rules='auto+fsdp'" in out, out
    assert "why: the fewest devices per example (mp x cp) that fit (nothing tried at mp=1, " \
           "mp=2 fits); at mp=1 cp=2 it fits without remat" in out, out
    with pytest.raises(SystemExit, match="No layout fits"):  # only context parallelism fits
        main(model + ["--context-shards", "1"])


def test_a_model_that_cannot_split_the_sequence_is_planned_without_it():
    params = {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32)}
    batch = {"x": jax.ShapeDtypeStruct((4, 64), jnp.float32)}
    loss = lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2)
    lines = []
    result = plan(params, loss, batch, 8, 2**40, rule_sets=("auto",), context_degrees=None,
                  try_all=True, log=lines.append)
    assert [(t.n_model_shards, t.n_context_shards) for t in result.tried] == [
        (1, 1), (2, 1), (4, 1), (8, 1)]
    assert sum("cannot run over a split sequence" in line for line in lines) == 1, lines
    with pytest.raises(PlanError, match=r"n_context_shards in \[2, 4\]\), but the model's "
                                        r"attention cannot run over a split sequence"):
        plan(params, loss, batch, 8, 2**40, rule_sets=("auto",), context_degrees=[2, 4])


def test_auto_deployer_trains_with_the_planned_context_degree_as_with_it_given(tmp_path):
    from redco import Deployer, Trainer
    from redco_zoo_lm import collate_fn, loss_fn

    def train(**layout):
        apply_fn, params = one_head_lm(abstract=False)
        deployer = Deployer(jax_seed=0, workdir=str(tmp_path / str(len(layout))), verbose=False,
                            sharding_rules="auto+fsdp", **layout)
        trainer = Trainer(deployer, collate_fn, apply_fn, loss_fn, params, optax.adamw(1e-2),
                          remat="none")
        trainer.fit(lm_examples(16, seq_len=SEQ_LEN), per_device_batch_size=1, n_epochs=1)
        return deployer, jax.device_get(trainer.state.params)

    planned, params = train(n_model_shards="auto", device_memory=BUDGET)
    assert dict(planned.mesh.shape) == {"dp": 4, "cp": 2, "mp": 1}
    assert planned.n_context_shards == 2
    assert [t.fits for t in planned.layout_plan.tried] == [False, False, True]
    _, given = train(n_model_shards=1, n_context_shards=2)
    jax.tree.map(np.testing.assert_array_equal, params, given)
