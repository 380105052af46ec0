"""Expert parallelism (``redco_zoo_models.expert_parallel``) against one device: the MoE block's
loss and gradients with its experts split over dp = 2, 4, 8 devices (and dp 4 x mp 2), dropless
and with a capacity (against the per-source-device drop rule written out here), gpt-oss's
expert biases split with their experts, Qwen3-Next's gated shared expert beside them, the FSDP
gathers it turns off, and the bad inputs it refuses before compiling."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from scanned import first_layer_with
from test_moe import GPT_OSS, reference, with_random_biases

from redco import fsdp
from redco.sharding import make_mesh, specs_from_rules
from redco_zoo_models.expert_parallel import expert_parallel, sharding_rules
from redco_zoo_models.moe import MoE, MoEConfig

QWEN_NEXT = dict(shared_expert_size=12, shared_expert_gate=True)  # a gated shared expert
LLAMA_4 = dict(router="top_k_sigmoid", expert_input_scaled=True, top_k=1,  # router-scaled
               normalize_top_k=False,
               n_shared_experts=1)  # inputs, beside a shared expert
X = jax.random.normal(jax.random.PRNGKey(1), (8, 4, 16))  # 32 tokens


def block(**overrides):
    cfg = MoEConfig(**{**dict(hidden_size=16, n_experts=8, top_k=2, expert_size=8), **overrides})
    return MoE(cfg, nnx.Rngs(0))


def mesh_of(dp: int, mp: int = 1):
    return make_mesh(jax.devices()[:dp * mp], mp)


def loss_and_grads(moe: MoE, mesh=None):
    """``(loss, grads, aux, jaxpr text)`` of a loss over the block's output, with the block's
    experts split over ``mesh``'s dp (laid out by ``sharding_rules``) or on one device."""
    graphdef, params = nnx.split(moe, nnx.Param)
    x = X

    def loss(params, x):
        with expert_parallel(mesh):
            y, aux = nnx.merge(graphdef, params)(x)
        return jnp.sum(jnp.sin(y)) + aux["aux_loss"], aux
    if mesh is not None:
        specs = specs_from_rules(params, sharding_rules(), mesh)
        params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
        x = jax.device_put(X, NamedSharding(mesh, P("dp")))
    step = jax.value_and_grad(loss, has_aux=True)
    (value, aux), grads = jax.jit(step)(params, x)
    return value, grads, aux, str(jax.make_jaxpr(step)(params, x))


@pytest.mark.parametrize("dp, mp, overrides", [(1, 1, {}), (2, 1, {}), (4, 1, {}), (8, 1, {}),
                                               (4, 2, {}), (4, 2, GPT_OSS), (4, 1, QWEN_NEXT),
                                               (4, 1, LLAMA_4)])
def test_dropless_equals_one_device(dp, mp, overrides):
    moe = with_random_biases(block(**overrides)) if overrides.get("expert_bias") else \
        block(**overrides)
    want, want_grads, _, _ = loss_and_grads(moe)
    got, grads, aux, jaxpr = loss_and_grads(moe, mesh_of(dp, mp))
    assert ("all_to_all" in jaxpr) == (dp > 1)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    assert float(aux["dropped_share"]) == 0


def per_source_drops(moe: MoE, dp: int) -> set:
    """The (token, expert) pairs dropped when each of ``dp`` devices fills each expert's
    capacity for its own tokens: first choices first, in its token order."""
    tokens = X.reshape(-1, 16)
    n = tokens.shape[0] // dp
    chosen, capacity, dropped = np.asarray(moe.route(tokens)[0]), moe.cfg.capacity(n), set()
    for source in range(dp):
        taken = np.zeros(moe.cfg.n_experts, int)
        for k in range(moe.cfg.top_k):
            for t in range(source * n, (source + 1) * n):
                e = int(chosen[t, k])
                taken[e] += 1
                if taken[e] > capacity:
                    dropped.add((t, e))
    return dropped


@pytest.mark.parametrize("dp, mp, overrides", [(4, 1, {}), (4, 2, {}), (4, 2, GPT_OSS)])
def test_a_capacity_drops_by_the_per_source_device_rule(dp, mp, overrides):
    moe = block(capacity_factor=1.0, **overrides)  # 8 tokens a device x 2 / 8 experts: 2 slots
    if overrides:
        with_random_biases(moe)
    dropped = per_source_drops(moe, dp)
    graphdef, params = nnx.split(moe, nnx.Param)
    mesh = mesh_of(dp, mp)
    with expert_parallel(mesh):
        y, aux = jax.jit(lambda p: nnx.merge(graphdef, p)(X))(params)
    assert dropped, "the test needs some pairs over capacity"
    np.testing.assert_allclose(np.asarray(y), reference(moe, X, dropped), rtol=2e-4, atol=2e-5)
    assert float(aux["dropped_share"]) == pytest.approx(len(dropped) / 64)


def test_expert_biases_are_split_with_their_experts():
    """gpt-oss's expert biases go where their experts go: on the experts over dp, by the EP
    rules here and by the core's ``auto+ep`` / ``auto+fsdp+ep`` rule sets (a gate or up bias on
    its outputs over mp, as its projection; a down bias whole over mp)."""
    from redco import Deployer
    params = nnx.split(block(**GPT_OSS), nnx.Param)[1]
    want = {"gate_proj_bias": P("dp", "mp"), "up_proj_bias": P("dp", "mp"),
            "down_proj_bias": P("dp", None), "gate_proj": P("dp", None, "mp")}
    for rules in (sharding_rules(), "auto+ep", "auto+fsdp+ep"):
        deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=None, verbose=False,
                            sharding_rules=rules if isinstance(rules, str) else "auto")
        found = specs_from_rules(params, rules if not isinstance(rules, str) else
                                 deployer.get_sharding_rules(params), deployer.mesh)
        got = {k: tuple(found["experts"][k]) for k in want}  # (trailing Nones as written)
        assert got == {k: tuple(v)[:len(got[k])] for k, v in want.items()}, (rules, got)


def test_fsdp_leaves_the_expert_weights_split():
    """Under FSDP every dp-split weight is gathered before its layer; the experts' are not,
    once ``expert_parallel`` is entered with the step's params."""
    mesh = mesh_of(4, 2)
    params = nnx.split(block(), nnx.Param)[1]
    specs = specs_from_rules(params, sharding_rules() + [("gate/kernel", P("dp"))], mesh)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    leaves = dict(zip(["down", "gate", "up", "router"], jax.tree.leaves(params)))
    with fsdp.gathering(params, shardings):
        assert all(fsdp.targets(list(leaves.values())))
        with expert_parallel(mesh, params):
            assert fsdp.targets(list(leaves.values()))[:3] == [None] * 3
            assert fsdp.targets([leaves["router"]])[0] is not None  # other weights: gathered


def test_experts_that_do_not_split_are_refused_before_compiling():
    moe = block(n_experts=6)
    with pytest.raises(ValueError, match="n_experts=6 do not split over the 4 devices of "
                       "expert parallelism"), expert_parallel(mesh_of(4)):
        jax.eval_shape(moe, X)


def test_tokens_that_do_not_split_are_padded_with_tokens_that_pick_no_expert():
    moe, x = block(), X.reshape(-1, 16)[:30]
    want, want_aux = moe(x)
    with expert_parallel(mesh_of(4)):
        got, aux = jax.jit(lambda x: moe(x))(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert float(aux["dropped_share"]) == 0 and aux["expert_load"].sum() == 60


def test_a_bad_top_k_or_capacity_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="top_k=9 with n_experts=8"):
        block(top_k=9)
    with pytest.raises(ValueError, match="capacity_factor=0.0: give a positive factor"):
        block(capacity_factor=0.0)  # (any positive factor leaves every expert a slot)


def test_a_tiny_moe_trains_with_its_experts_split_as_on_one_device():
    """An update of a tiny Qwen3-MoE through ``Trainer`` (dp 2 x cp 2 x mp 2, ``auto+fsdp``),
    its experts split over dp as ``--expert_parallel`` splits them (``for_trainer``): each
    device holds two experts' share of the weights, never all-gathered by FSDP (the other
    weights are), and the params are one device's (1e-5, fp32)."""
    import optax
    from test_context_parallel import deployer_of, packed_rows

    from redco import Trainer
    from redco_zoo_lm import collate_fn, loss_fn
    from redco_zoo_models import split_model
    from redco_zoo_models.expert_parallel import for_trainer
    from redco_zoo_models.toy import tiny_family

    def trainer(deployer, expert_split: bool):
        apply_fn, params = split_model(tiny_family("qwen3-moe"))
        rules = for_trainer(params, deployer) if expert_split else None
        return Trainer(deployer, collate_fn, apply_fn, loss_fn, params, optax.sgd(0.5),
                       params_sharding_rules=rules)
    rows = packed_rows(4)  # one update
    one, split = trainer(deployer_of(one_device=True), False), \
        trainer(deployer_of(2, 2, rules="auto+fsdp"), True)
    one.train_epoch(rows, 4, 0)
    split.train_epoch(rows, 2, 0)
    experts, lead = first_layer_with(split.params["model"]["layers"], "mlp/experts")
    assert experts["gate_proj"].sharding.spec == P(*lead, "dp", None, "mp")
    assert experts["down_proj"].sharding.spec == P(*lead, "dp", "mp", None)
    for a, b in zip(jax.tree.leaves(jax.device_get(split.params)),
                    jax.tree.leaves(jax.device_get(one.params))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    hlo = split.compile_train_step(rows, 2).as_text()
    assert "all-to-all" in hlo
    gathered = {shape for shape in re.findall(r"= f32\[([\d,]+)\]\S* all-gather\(", hlo)}
    assert gathered and not {"4,32,12", "4,12,32"} & gathered, gathered  # (FSDP's: the rest)
