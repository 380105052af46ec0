"""LoRA (``redco.lora``, and the zoo's in-projection ``LoRALinear``): adapters start at the
base model, merge to ``W + (alpha / r) A @ B``, train on dp4 x mp2 with the base bitwise
frozen, are sharded like their kernels (the base's plan unchanged), take no optimizer state or
gradient memory for the base (XLA's memory analysis of the compiled step), and resume bitwise."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import redco
from redco import Deployer, Trainer, lora
from redco.sharding import named_leaves
from redco_zoo_lm import collate_fn, loss_fn
from redco_zoo_models import LlamaConfig, LlamaForCausalLM, add_lora, split_model
from redco_zoo_models.toy import tiny_llama

IDS = np.random.default_rng(0).integers(0, 16, (4, 9)).astype(np.int32)
EXAMPLES = [{"token_ids": row} for row in np.random.default_rng(1).integers(0, 16, (128, 9))]


def generic(rank=4, alpha=8.0, seed=0):
    """``redco.lora.add_lora`` on the params of a tiny LLaMA: the merge-on-the-fly wrapper."""
    apply_fn, params = split_model(tiny_llama(16, seed=seed, scan_layers=False))
    return apply_fn, params, lora.add_lora(params, apply_fn, rank=rank, alpha=alpha)


def zoo(rank=4, alpha=8.0, cfg=None):
    """The zoo's in-projection LoRA: ``(apply_fn, params, trainable)``."""
    model = LlamaForCausalLM(cfg, nnx.Rngs(0)) if cfg else tiny_llama(16, scan_layers=False)
    apply_fn, params = split_model(add_lora(model, rank=rank, alpha=alpha))
    return apply_fn, params, lora.trainable_mask(params)


def trainer_for(apply_fn, params, trainable=None, workdir=None, optimizer=None, callbacks=()):
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=workdir, verbose=False)
    return Trainer(deployer, collate_fn, apply_fn, loss_fn, params,
                   optimizer or optax.adamw(1e-2), trainable=trainable, callbacks=callbacks)


def flat(tree):
    return {p: np.asarray(x) for p, x in named_leaves(jax.device_get(tree))}


def bump(params, value=0.05):
    """B factors made non-zero, so the adapters change the model."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: x + value if "lora_b" in str(p) else x,
        params)


def test_adapters_at_init_give_the_base_models_outputs_bit_for_bit():
    apply_fn, params, adapted = generic()
    np.testing.assert_array_equal(adapted.apply_fn(adapted.params, IDS), apply_fn(params, IDS))
    zoo_apply, zoo_params, _ = zoo()
    np.testing.assert_array_equal(zoo_apply(zoo_params, IDS), apply_fn(params, IDS))
    assert flat(adapted.params).keys() == flat(zoo_params).keys()  # one naming for both paths
    b = [x for p, x in flat(adapted.params).items() if p.endswith("lora_b")]
    assert b and all(not x.any() for x in b)


def test_merge_is_the_base_plus_scaled_low_rank_product_and_drops_the_adapters():
    apply_fn, params, adapted = generic(rank=4, alpha=8.0)
    trained = bump(adapted.params)
    merged, got = flat(lora.merge(trained, 8.0)), flat(trained)
    assert merged.keys() == flat(params).keys()
    path = "model/layers/1/self_attn/q_proj"
    want = got[f"{path}/kernel"] + 2.0 * got[f"{path}/lora_a"] @ got[f"{path}/lora_b"]
    np.testing.assert_allclose(merged[f"{path}/kernel"], want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(merged["model/embed_tokens/embedding"],
                                  got["model/embed_tokens/embedding"])
    # the merged model computes what the adapted one does, and so does the zoo's LoRALinear
    np.testing.assert_allclose(apply_fn(lora.merge(trained, 8.0), IDS),
                               adapted.apply_fn(trained, IDS), rtol=1e-5, atol=1e-5)
    zoo_apply, zoo_params, _ = zoo(rank=4, alpha=8.0)
    np.testing.assert_allclose(zoo_apply(bump(zoo_params), IDS), adapted.apply_fn(trained, IDS),
                               rtol=1e-5, atol=1e-5)


def kernel_specs(trainer):
    return {p: x.sharding.spec for p, x in named_leaves(trainer.params)}


def normal(spec, ndim=2):
    return tuple(list(spec) + [None] * (ndim - len(spec)))


@pytest.mark.parametrize("path", ["generic", "zoo"])
def test_training_on_dp4_mp2_leaves_the_base_bitwise_and_shards_adapters_like_kernels(path):
    apply_fn, params, adapted = generic()
    if path == "generic":
        lora_apply, lora_params, mask = adapted.apply_fn, adapted.params, adapted.trainable
    else:
        lora_apply, lora_params, mask = zoo()
    before = flat(lora_params)
    trainer = trainer_for(lora_apply, lora_params, mask)
    trainer.fit(EXAMPLES, 4, n_epochs=1)
    assert dict(trainer.deployer.mesh.shape) == {"dp": 4, "mp": 2}
    after = flat(trainer.params)
    for name, value in after.items():
        if lora.is_adapter_path(name):
            continue
        np.testing.assert_array_equal(value, before[name], err_msg=f"frozen {name} changed")
    assert all(np.abs(after[p] - before[p]).max() > 0 for p in after if p.endswith("lora_b"))

    specs = kernel_specs(trainer)
    full = trainer_for(apply_fn, params)
    full.eval_loss(EXAMPLES[:8], 1)  # decides the layout of the model without adapters
    assert {p: s for p, s in specs.items() if not lora.is_adapter_path(p)} == kernel_specs(full)
    split = 0
    for kernel in lora.kernel_paths(params):
        a, b = normal(specs[kernel])
        parent = kernel.rsplit("/", 1)[0]
        assert normal(specs[f"{parent}/lora_a"]) == (a, None), (kernel, specs[kernel])
        assert normal(specs[f"{parent}/lora_b"]) == (None, b), (kernel, specs[kernel])
        split += (a, b) != (None, None)
    assert split == len(lora.kernel_paths(params))  # every adapted kernel is split over mp


def test_the_frozen_base_has_no_optimizer_state():
    _, _, adapted = generic()
    trainer = trainer_for(adapted.apply_fn, adapted.params, adapted.trainable)
    trainer.eval_loss(EXAMPLES[:8], 1)
    state_size = sum(x.size for x in jax.tree.leaves(trainer.state.opt_state))
    n_adapters = lora.n_params(adapted.params, adapted.trainable)
    assert state_size == 2 * n_adapters + 1, (state_size, n_adapters)  # Adam's mu, nu; count


def train_step_memory(apply_fn, params, trainable=None) -> dict:
    """Per-device bytes of the compiled train step on dp4 x mp2 (XLA's memory analysis)."""
    trainer = trainer_for(apply_fn, params, trainable)
    analysis = trainer.compile_train_step(EXAMPLES[:8], 1).memory_analysis()
    return {"arguments": analysis.argument_size_in_bytes, "temp": analysis.temp_size_in_bytes}


def test_memory_analysis_of_the_train_step_shows_no_gradient_or_adam_memory_for_the_base():
    cfg = LlamaConfig(vocab_size=16, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, scan_layers=False)
    apply_fn, params = split_model(LlamaForCausalLM(cfg, nnx.Rngs(0)))
    base = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)) / 2  # per device
    adapted = lora.add_lora(params, apply_fn, rank=4)
    full = train_step_memory(apply_fn, params)
    merged = train_step_memory(adapted.apply_fn, adapted.params, adapted.trainable)
    inside = train_step_memory(*zoo(rank=4, cfg=cfg))
    print(f"per-device bytes, params {base:.0f}: full {full}, LoRA merged on the fly {merged}, "
          f"LoRA in the projection {inside}")
    # full fine-tuning holds params + Adam's mu and nu (3x), and makes a gradient per param
    # (each reduced and applied on its own, so not all alive at once: many times LoRA's temp)
    assert full["arguments"] > 2.8 * base and full["temp"] > 5 * inside["temp"]
    # LoRA: the base's params and the adapters' small state only (Adam on the base: 3x)
    for lora_bytes in (merged, inside):
        assert lora_bytes["arguments"] < 1.15 * base, lora_bytes
    # in the projection, no full-size kernel gradient or merged kernel is ever made
    assert inside["temp"] < 0.25 * base, inside
    assert inside["temp"] < merged["temp"]


@pytest.mark.parametrize("policy", ["none", "full"])
@pytest.mark.parametrize("rows", [3, 16])  # 15 tokens: two products; 80: W + A @ B merged
def test_the_zoo_projections_gradients_are_those_of_the_plain_formula(policy, rows):
    """``LoRALinear``'s own backward pass (it keeps only ``x``) gives the gradients of
    ``x @ W + ((x @ A) @ B) * s`` for x, A, B and, when it is trained too, the kernel W."""
    from redco_zoo_models.lora import LoRALinear
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    layer = LoRALinear(nnx.Linear(24, 40, rngs=nnx.Rngs(0)), rank=4, alpha=8.0, key=keys[0])
    layer.lora_b[...] = jax.random.normal(keys[1], (4, 40)) / 4  # B = 0 would hide A's gradient
    x = jax.random.normal(keys[2], (rows, 5, 24))
    target = jax.random.normal(keys[3], (rows, 5, 40))
    plain = lambda w, a, b, bias, x: x @ w + ((x @ a) @ b) * layer.scale + bias  # noqa: E731
    args = (layer.kernel[...], layer.lora_a[...], layer.lora_b[...], layer.bias[...], x)

    apply_fn, params = split_model(layer)

    def adapted(w, a, b, bias, x):
        given = {"kernel": w, "lora_a": a, "lora_b": b, "bias": bias}
        return apply_fn(jax.tree_util.tree_map_with_path(
            lambda p, _: given[p[0].key], params), x)
    for forward in (plain, adapted):
        loss = lambda *p, f=forward: jnp.sum(jnp.sin(redco.remat.layer(  # noqa: E731
            lambda *q: f(*q))(*p)) * target)
        with redco.remat.policy(policy):
            grads = jax.grad(loss, argnums=tuple(range(5)))(*args)
        if forward is plain:
            expected = grads
    for name, got, want in zip(("W", "A", "B", "bias", "x"), grads, expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)


def backward_bytes(cfg, kind: str, policy: str) -> int:
    """Bytes the backward pass keeps of the zoo LLaMA's loss (``jax.vjp``'s residuals, each array
    once, params and inputs not counted) under remat ``policy``: ``"full"`` fine-tuning, or
    ``"lora"`` (rank 8, base frozen)."""
    model = LlamaForCausalLM(cfg, nnx.Rngs(0))
    if kind == "lora":
        add_lora(model, rank=8)
    apply_fn, params = split_model(model)
    mask = lora.trainable_mask(params) if kind == "lora" else jax.tree.map(lambda _: True, params)
    train = jax.tree.map(lambda x, m: x if m else None, params, mask)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 48)), jnp.int32)

    def loss(train):
        merged = jax.tree.map(lambda t, p: p if t is None else t, train, params,
                              is_leaf=lambda x: x is None)
        return apply_fn(merged, ids).astype(jnp.float32).sum()
    with redco.remat.policy(policy):
        _, vjp = jax.vjp(loss, train)
    given = {id(x) for x in jax.tree.leaves(params)}
    kept = {id(x): x for x in jax.tree.leaves(vjp) if id(x) not in given and x.size > 1}
    return sum(x.size * x.dtype.itemsize for x in kept.values())


# Every remat policy, dots_with_no_batch_dims_saveable in the slow tier only: it differs from
# dots_saveable in the dots with batch dims (attention's), which LoRA does not touch; the
# projections LoRA adapts are saved alike under both, and dots_saveable runs in CI.
POLICIES = [pytest.param(p, marks=[pytest.mark.slow] * (p == "dots_with_no_batch_dims_saveable"))
            for p in redco.remat.POLICIES]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("hidden", [64, pytest.param(128, marks=pytest.mark.slow)])
def test_a_lora_projection_keeps_what_the_base_projection_keeps_plus_x_a(hidden, policy):
    """Under every remat policy, LoRA's backward pass keeps no more than full fine-tuning's
    plus the rank-8 ``x @ A`` of each adapted projection: never ``x @ W`` and ``(x @ A) @ B``
    both (under dots_saveable the unmarked sum kept both: +316 KiB at hidden 64)."""
    cfg = LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                      scan_layers=False)
    x_a = 2 * 48 * 8 * 4 * 7 * cfg.num_hidden_layers  # [rows, tokens, r] f32, 7 per layer
    full, adapted = backward_bytes(cfg, "full", policy), backward_bytes(cfg, "lora", policy)
    assert adapted <= full + x_a, (policy, adapted, full, x_a)


def compiled_step_bytes(cfg, kind: str, policy: str) -> tuple[int, int, int]:
    """``(peak, temp, base param bytes)`` per device of the train step a ``Trainer`` compiles
    (dp8, two 256-token rows per device) for ``"full"`` fine-tuning or ``"lora"`` (rank 8)."""
    model = LlamaForCausalLM(cfg, nnx.Rngs(0))
    if kind == "lora":
        add_lora(model, rank=8)
    apply_fn, params = split_model(model)
    deployer = Deployer(jax_seed=0, n_model_shards=1, verbose=False)
    trainer = Trainer(deployer, collate_fn, apply_fn, loss_fn, params, optax.adamw(1e-3),
                      remat=policy, trainable=lora.trainable_mask(params) if kind == "lora" else None)
    rows = np.random.default_rng(0).integers(0, cfg.vocab_size, (16, 257))
    m = trainer.compile_train_step([{"token_ids": r} for r in rows], 2).memory_analysis()
    base = sum(x.size * x.dtype.itemsize for p, x in named_leaves(params) if not lora.is_adapter_path(p))
    return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes, m.temp_size_in_bytes, base)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("hidden,layers", [(256, 2), pytest.param(512, 4, marks=pytest.mark.slow)])
def test_the_compiled_lora_step_peaks_below_full_fine_tuning_by_adams_moments(hidden, layers,
                                                                             policy):
    """Under every remat policy, the compiled step's peak with LoRA is at least 2x the base's
    param bytes (AdamW's moments, which LoRA keeps none of) below full fine-tuning's: LoRA's
    activations and temporaries are no more than full fine-tuning's."""
    cfg = LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                      scan_layers=False)
    full_peak, full_temp, base = compiled_step_bytes(cfg, "full", policy)
    lora_peak, lora_temp, _ = compiled_step_bytes(cfg, "lora", policy)
    print(f"{policy}: peak full {full_peak / 2**20:.1f} MB, LoRA {lora_peak / 2**20:.1f} MB; "
          f"temp full {full_temp / 2**20:.1f}, LoRA {lora_temp / 2**20:.1f}; "
          f"base {base / 2**20:.1f} MB")
    assert full_peak - lora_peak >= 2 * base, (policy, full_peak, lora_peak, base)


class StepLog:
    """A per-run plugin that records the step of every update this run made."""

    def __init__(self):
        self.steps: list[int] = []

    @redco.hookimpl
    def on_step_end(self, trainer, step, metrics):
        self.steps.append(step)


def test_lora_resumes_to_the_same_bits(tmp_path):
    def run(workdir, n_epochs) -> tuple[Trainer, list[int]]:
        _, _, adapted = generic()
        log = StepLog()
        trainer = trainer_for(adapted.apply_fn, adapted.params, adapted.trainable,
                              workdir=str(workdir), optimizer=optax.adamw(1e-2), callbacks=[log])
        trainer.fit(EXAMPLES, 4, n_epochs=n_epochs, save_every_n_steps=3)
        return trainer, log.steps
    straight, straight_steps = run(tmp_path / "straight", 2)
    _, first_steps = run(tmp_path / "stopped", 1)
    resumed, resumed_steps = run(tmp_path / "stopped", 2)  # picks up epoch 1's last checkpoint
    assert straight_steps == list(range(1, 17)) and first_steps == list(range(1, 9))
    assert resumed_steps == list(range(9, 17)), "the rerun did not continue from step 8"
    log_txt = (tmp_path / "stopped" / "log.txt").read_text()
    assert "step_8 (step 8)" in log_txt, "no 'Resumed from .../step_8 (step 8)' in log.txt"
    assert resumed.step == straight.step
    for name, value in flat(straight.params).items():
        np.testing.assert_array_equal(flat(resumed.params)[name], value, err_msg=name)
    for a, b in zip(jax.tree.leaves(straight.state.opt_state),
                    jax.tree.leaves(resumed.state.opt_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bad_lora_settings_are_refused_naming_the_fix():
    apply_fn, params = split_model(tiny_llama(16))
    with pytest.raises(ValueError, match=r"select no 2-D kernel.*model/"):
        lora.add_lora(params, apply_fn, targets=r"attention/kernel$")
    with pytest.raises(ValueError, match=r"rank 64 does not fit .*k_proj/kernel \(64, 32\).*1 to 32"):
        lora.add_lora(params, apply_fn, rank=64)
    with pytest.raises(ValueError, match="not a regex"):
        lora.add_lora(params, apply_fn, targets="q_proj(")
    adapted = lora.add_lora(params, apply_fn)
    with pytest.raises(ValueError, match="trainable must be a pytree of bools shaped like params"):
        trainer_for(adapted.apply_fn, adapted.params, lora.trainable_mask(params))
    with pytest.raises(ValueError, match="marks no param"):
        trainer_for(adapted.apply_fn, adapted.params,
                    jax.tree.map(lambda _: False, adapted.trainable))


def test_lora_works_on_a_plain_dict_of_arrays():
    """Any params pytree of nested dicts: a two-layer MLP written by hand."""
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    params = {"mlp": {"fc1": {"kernel": jax.random.normal(keys[0], (8, 16))},
                      "fc2": {"kernel": jax.random.normal(keys[1], (16, 4))}}}

    def apply_fn(p, x):
        return jax.nn.relu(x @ p["mlp"]["fc1"]["kernel"]) @ p["mlp"]["fc2"]["kernel"]
    adapted = lora.add_lora(params, apply_fn, rank=2, alpha=4.0)
    assert sorted(adapted.params["mlp"]["fc1"]) == ["kernel", "lora_a", "lora_b"]
    assert "lora_a" not in params["mlp"]["fc1"]  # the given tree is left as it was
    x = jnp.ones((3, 8))
    np.testing.assert_array_equal(adapted.apply_fn(adapted.params, x), apply_fn(params, x))
    assert jax.tree.structure(adapted.merge()) == jax.tree.structure(params)
    specs = lora.follow_kernels({"mlp/fc1/kernel": P(None, "mp"), "mlp/fc1/lora_a": P("mp"),
                                 "mlp/fc1/lora_b": P()},
                                {"mlp/fc1/kernel": (8, 16)})
    assert specs["mlp/fc1/lora_a"] == P() and specs["mlp/fc1/lora_b"] == P(None, "mp")


def test_the_docs_lora_block_runs_as_written():
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from readme_blocks import block
    apply_fn, params = split_model(tiny_llama(16))
    names = {"deployer": Deployer(jax_seed=0, n_model_shards=2, workdir=None, verbose=False),
             "collate_fn": collate_fn, "loss_fn": loss_fn, "apply_fn": apply_fn,
             "params": params, "train": EXAMPLES}
    exec(block("lora", "docs/guides/lora-and-remat.md"), names)  # noqa: S102 - the docs' own code
    assert jax.tree.structure(names["merged"]) == jax.tree.structure(params)
    trained = flat(names["trainer"].params)
    assert all(np.abs(x).max() > 0 for p, x in trained.items() if p.endswith("lora_b"))
