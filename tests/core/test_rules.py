"""The built-in ``auto`` rules: the paper's two rules on real parameter trees."""
import re

import jax
import numpy as np
import optax
import pytest
from helpers import lm_examples, lm_model, mlp_apply, mlp_collate, mlp_examples, mlp_init, mlp_loss, train
from jax.sharding import PartitionSpec as P

from redco import Deployer, Trainer
from redco.builtins.rules import FSDP_MIN_SIZE
from redco.sharding import path_str, specs_from_rules
from redco_zoo_lm import collate_fn as lm_collate
from redco_zoo_lm import loss_fn as lm_loss

COLUMN, ROW = P(None, "mp"), P("mp", None)


def specs(params, deployer, rules=None):
    found = specs_from_rules(params, deployer.get_sharding_rules(params, rules), deployer.mesh)
    leaves = jax.tree_util.tree_flatten_with_path(found, is_leaf=lambda x: isinstance(x, P))[0]
    return {path_str(path): spec for path, spec in leaves}


def test_mlp_kernels_alternate_in_natural_order(workdir):
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=workdir, verbose=False)
    got = specs(mlp_init(), deployer)
    assert [got[f"Dense_{i}/kernel"] for i in range(12)] == [COLUMN, ROW] * 6  # Dense_10 after 9
    assert all(got[f"Dense_{i}/bias"] == P() for i in range(12))


def test_llama_attention_and_swiglu_get_megatron_layout(workdir):
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=workdir, verbose=False)
    _, params = lm_model()
    got = specs(params, deployer)
    for layer in range(2):
        prefix = f"model/layers/{layer}/"
        for name in ("self_attn/q_proj", "self_attn/k_proj", "self_attn/v_proj", "mlp/gate_proj",
                     "mlp/up_proj"):
            assert got[prefix + name + "/kernel"] == COLUMN, name
        for name in ("self_attn/o_proj", "mlp/down_proj"):
            assert got[prefix + name + "/kernel"] == ROW, name
        assert got[prefix + "input_layernorm/weight"] == P()
    assert got["model/embed_tokens/embedding"] == ROW and got["lm_head/kernel"] == COLUMN


def test_llama_train_step_needs_no_all_gather(workdir):
    """Column then row parallel: activations stay sharded, only all-reduces remain."""
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=workdir, verbose=False)
    apply_fn, params = lm_model()
    trainer = Trainer(deployer, lm_collate, apply_fn, lm_loss, params, optax.adamw(1e-3))
    hlo = trainer.compile_train_step(lm_examples(8), 1).as_text()
    assert len(re.findall(r"all-gather(-start)?\(", hlo)) == 0
    assert len(re.findall(r"all-reduce(-start)?\(", hlo)) > 0


def test_user_rules_override_and_bad_fits_replicate_with_one_warning(workdir):
    deployer = Deployer(jax_seed=0, n_model_shards=8, workdir=workdir, verbose=False)
    params = mlp_init()  # Dense_0 kernel is (8, 16), Dense_11 kernel (16, 1)
    with pytest.warns(UserWarning, match=r"replicated instead: Dense_11/kernel \(16, 1\) by "
                                         r"P\(None, 'mp'\)$"):
        got = specs(params, deployer, rules=[(r"Dense_0/kernel", ROW),
                                             (r"Dense_11/kernel", COLUMN)])
    assert got["Dense_0/kernel"] == ROW and got["Dense_1/kernel"] == ROW
    assert got["Dense_11/kernel"] == P()
    trainer = Trainer(deployer, mlp_collate, mlp_apply, mlp_loss, params, optax.sgd(0.1),
                      params_sharding_rules=[(r"Dense_0/kernel", ROW)])
    trainer.fit(mlp_examples(16), 2, n_epochs=1)
    assert trainer.params["Dense_0"]["kernel"].sharding.spec == ROW
    assert trainer.params["Dense_1"]["kernel"].sharding.spec == P()  # no rule: replicated


def per_device_bytes(tree) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("rule_set,n_model_shards", [("fsdp", 1), ("auto+fsdp", 2)])
def test_fsdp_trains_like_one_device_on_a_fraction_of_the_memory(rule_set, n_model_shards,
                                                                workdir):
    ref_losses, _, _ = train("lm", workdir + "ref", 1, n_local_devices=1)
    losses, _, trainer = train("lm", workdir, n_model_shards, sharding_rules=rule_set)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    params, opt_state = trainer.state.params, trainer.state.opt_state
    for x in jax.tree.leaves(params):
        if x.size >= FSDP_MIN_SIZE:  # every large param is split over all 8 devices
            assert x.addressable_shards[0].data.nbytes == x.nbytes // 8
    assert per_device_bytes(opt_state) <= 2 * per_device_bytes(params) + 64  # Adam's mu and nu
    specs = {s.spec for s in jax.tree.leaves(trainer.state_shardings.params)}
    assert any("dp" in spec for spec in specs)
    assert ("mp" in str(specs)) == (n_model_shards > 1)


def test_an_fsdp_step_reduces_each_gradient_apart(workdir):
    """No all-reduce of a compiled ``auto+fsdp`` step carries more than one layer's worth of
    gradients: XLA's CPU backend merged them all into one at the end of the step, holding every
    full-size gradient at once (``redco.train_step.compiler_options`` turns that off, for what
    ``compile_train_step`` and the planner measure; the step a run executes merges them)."""
    deployer = Deployer(jax_seed=0, workdir=workdir, verbose=False, sharding_rules="auto+fsdp")
    apply_fn, params = lm_model()
    trainer = Trainer(deployer, lm_collate, apply_fn, lm_loss, params, optax.adamw(1e-3),
                      remat="full")
    hlo = trainer.compile_train_step(lm_examples(8), 1).as_text()
    itemsize = {"f32": 4, "bf16": 2, "s32": 4, "pred": 1}
    reduced = [sum(itemsize[t] * int(np.prod([int(d) for d in dims.split(",") if d]))
                   for t, dims in re.findall(r"(f32|bf16|s32|pred)\[([\d,]*)\]", shapes))
               for shapes in re.findall(r"= (\(.*?\)|\S+) all-reduce\(", hlo)]
    layer = sum(x.nbytes for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
                if path_str(path).startswith("model/layers/0/"))
    assert reduced and max(reduced) <= layer, (max(reduced), layer)
    # The step a run executes keeps XLA's merging: the all-reduces apart were 0.91x of a plain
    # jax.jit loop's speed on CPU (bench/trainer_vs_jit.py).
    executed = trainer.lower_train_step(lm_examples(8), 1).compile().as_text()
    assert executed.count(" all-reduce(") < len(reduced), (executed.count(" all-reduce("),
                                                           len(reduced))


def test_a_rules_list_is_the_whole_rule_set_and_names_are_checked_early(workdir):
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=workdir, verbose=False,
                        sharding_rules=[(r"Dense_(0|1)/kernel", ROW)])
    got = specs(mlp_init(), deployer, rules=[(r"Dense_1/kernel", COLUMN)])
    assert got["Dense_0/kernel"] == ROW and got["Dense_1/kernel"] == COLUMN  # yours first
    assert got["Dense_2/kernel"] == P()  # no auto rules behind a list: replicated
    with pytest.raises(ValueError, match=r"No sharding rules named 'megatron'\. Available: "):
        Deployer(jax_seed=0, workdir=workdir, verbose=False, sharding_rules="megatron")
    with pytest.raises(ValueError, match="with your own rules list, set n_model_shards"):
        Deployer(jax_seed=0, n_model_shards="auto", device_memory="1GB", workdir=workdir,
                 verbose=False, sharding_rules=[(r"Dense_0", ROW)])
