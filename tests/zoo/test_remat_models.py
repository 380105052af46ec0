"""Rematerialisation on the zoo's models: the compiled train step (dp4 x mp2) needs less memory
and computes more under each policy than under the one before it, training with remat equals
training without, and every family's blocks are rematerialised one by one."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from step_rows import StepRows

from redco import Deployer, Trainer, lora, remat
from redco_zoo_lm import collate_fn, loss_fn
from redco_zoo_models import LlamaConfig, LlamaForCausalLM, add_lora, split_model
from redco_zoo_models.toy import tiny_t5, tiny_vit_gpt2

N_LAYERS = 3


def numpy_init(make_model):
    """``(apply_fn, params)`` of the model ``make_model`` builds, its params drawn by numpy
    (an eager Flax init compiles an XLA program per op: seconds)."""
    apply_fn, shapes = split_model(nnx.eval_shape(make_model))
    rng = np.random.default_rng(0)
    return apply_fn, jax.tree.map(lambda s: (0.2 * rng.normal(size=s.shape)).astype(s.dtype), shapes)


@functools.cache
def llama(lora_rank: int = 0):
    def make():
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=N_LAYERS,
            num_attention_heads=4, num_key_value_heads=2, scan_layers=False), nnx.Rngs(0))
        return add_lora(model, rank=lora_rank) if lora_rank else model  # (unrolled: a scanned
    # body's "none" keeps what dots_with_no_batch_dims_saveable keeps, tests/zoo/test_scan_layers.py)
    return numpy_init(make)


def trainer(policy, workdir=None, callbacks=(), sharding_rules="auto", lora_rank=0):
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=workdir, verbose=False,
                        compile_cache_dir=False, sharding_rules=sharding_rules)
    apply_fn, params = llama(lora_rank)  # Trainer places a copy of its own
    return Trainer(deployer, collate_fn, apply_fn, loss_fn, params, optax.sgd(0.1),
                   remat=policy, callbacks=callbacks,
                   trainable=lora.trainable_mask(params) if lora_rank else None)


def token_examples(n, seq_len, vocab=64, seed=0):
    rng = np.random.default_rng(seed)
    return [{"token_ids": (np.arange(seq_len + 1) * rng.integers(1, 4) + rng.integers(vocab)) % vocab}
            for _ in range(n)]


def test_each_policy_keeps_less_and_recomputes_more():
    """What the layout planner will compare: XLA's memory and cost analysis of one Trainer's
    real train step (3 layers, 128 tokens per device), compiled ahead of time under each
    policy, the model untouched. Measured: temp 1.61, 1.11, 0.71 MB; 23.9, 25.4, 30.8 MFLOP."""
    t = trainer(None)
    examples = token_examples(8, 128)
    stats = []
    for policy in ("none", "dots_saveable", "full"):
        with remat.policy(policy):  # jit's caches are keyed on it: each compiles anew
            compiled = t.compile_train_step(examples, 1)
        stats.append((compiled.memory_analysis().temp_size_in_bytes,
                      compiled.cost_analysis()["flops"]))
    (none, none_flops), (dots, dots_flops), (full, full_flops) = stats
    assert none > dots > full and full < 0.5 * none, stats
    assert none_flops < dots_flops < full_flops, stats


def fit(policy, workdir, sharding_rules="auto", lora_rank=0):
    metrics = StepRows()
    t = trainer(policy, workdir, [metrics], sharding_rules, lora_rank)
    t.fit(token_examples(32, 16), per_device_batch_size=2, n_epochs=1, eval_sanity_check=False)
    return np.array(metrics.rows), jax.device_get(t.params), t


@pytest.fixture(scope="module")
def without_remat(tmp_path_factory):
    """The reference both full-model tests compare with: ``auto``, no remat (one run)."""
    return fit("none", str(tmp_path_factory.mktemp("remat") / "none"))


def test_training_with_remat_equals_training_without(workdir, without_remat):
    """8 devices, dp4 x mp2, 4 updates of Trainer(remat="full"): losses, gradient norms and
    params equal Trainer(remat="none")'s to 1e-5, on the same layout."""
    ref_rows, ref_params, ref = without_remat
    traced = remat.layers_traced()
    rows, params, t = fit("full", workdir + "full")
    assert remat.layers_traced() - traced >= N_LAYERS  # the Trainer's policy was in force
    assert len(rows) == 4 and rows[-1, 0] < rows[0, 0]
    np.testing.assert_allclose(rows, ref_rows, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert t.state_shardings.params == ref.state_shardings.params


def test_fsdp_layers_gather_their_weights_and_train_as_without(workdir, without_remat):
    """dp4 x mp2 with ``auto+fsdp`` and ``full`` remat: each layer gathers its weights inside
    its checkpoint (``redco.fsdp``) and again in the backward pass; losses, gradient norms and
    params equal ``auto``'s without remat to 1e-5 (``tests/core/test_rules.py`` checks FSDP
    without remat)."""
    ref_rows, ref_params, _ = without_remat
    rows, params, t = fit("full", workdir + "fsdp", sharding_rules="auto+fsdp")
    assert any("dp" in str(s.spec) for s in jax.tree.leaves(t.state_shardings.params))
    np.testing.assert_allclose(rows, ref_rows, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_lora_layers_under_remat_train_as_without(workdir):
    """The zoo's LoRA layers (base frozen) under ``dots_saveable``, dp4 x mp2: losses, gradient
    norms and params equal no remat's to 1e-5, and only the adapters moved."""
    ref_rows, ref_params, _ = fit("none", workdir + "ref", lora_rank=4)
    traced = remat.layers_traced()
    rows, params, t = fit("dots_saveable", workdir + "remat", lora_rank=4)
    assert remat.layers_traced() - traced >= N_LAYERS
    np.testing.assert_allclose(rows, ref_rows, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    start = llama(4)[1]
    frozen = jax.tree.map(lambda m, p, s: m or np.array_equal(p, s), lora.trainable_mask(params),
                          params, start)
    assert all(jax.tree.leaves(frozen)), "a frozen base param changed"


def test_t5_remats_each_block_to_the_same_gradients():
    """T5's blocks take the position bias made outside them and cross-attend to the encoder:
    one remat per block (2 encoder, 2 decoder) and per embedding lookup (encoder, decoder:
    ``redco_zoo_models.layers.embed``), gradients equal to 1e-5."""
    apply_fn, params = numpy_init(lambda: tiny_t5(32))
    ids = jnp.asarray(np.random.default_rng(0).integers(3, 32, (2, 8)))

    def loss(params):
        return jnp.mean(jnp.sin(apply_fn(params, ids, None, ids)))
    grad = jax.jit(jax.value_and_grad(loss))
    ref = grad(params)
    with remat.policy("dots_saveable"):
        assert str(jax.make_jaxpr(loss)(params)).count("custom_vjp_call") == 4 + 2
        out = grad(params)  # traced again: jit's caches are keyed on the policy
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_vit_and_gpt2_remat_each_block():
    apply_fn, shapes = split_model(nnx.eval_shape(lambda: tiny_vit_gpt2(32, image_size=16)))
    pixels, ids = jnp.zeros((2, 3, 16, 16)), jnp.zeros((2, 8), jnp.int32)
    for policy, n_remat in (("none", 0), ("full", 2 + 2 + 2)):  # ViT's layers, GPT-2's blocks
        #                                                    and its token and position lookups
        with remat.policy(policy):
            jaxpr = jax.make_jaxpr(lambda p: apply_fn(p, pixels, ids).mean())(shapes)
        assert str(jaxpr).count("custom_vjp_call") == n_remat
