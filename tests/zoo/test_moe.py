"""The MoE block (``redco_zoo_models.moe``) against a per-token loop written here: top-k routing
by softmax and by sigmoid with the balancing bias, shared experts, gpt-oss's biased router and
experts with its clamped SwiGLU, dropless and with a capacity, its gradients, the auxiliary
losses at their known values, and the bias update, in ``Trainer.fit`` too."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from scanned import first_layer_with

import redco
from redco import Deployer, Trainer
from redco_zoo_models import split_model
from redco_zoo_models.balancing import (
    BalanceBias,
    moe_optimizer,
    sigmoid_choice,
    updated_balance_bias,
)
from redco_zoo_models.moe import MoE, MoEConfig


def reference(moe: MoE, x, dropped_pairs=frozenset()):
    """Each token through each expert it picks, one at a time, weighted; ``dropped_pairs``
    ``(token, expert)`` add nothing."""
    cfg, tokens = moe.cfg, np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    names = ("gate_proj", "up_proj", "down_proj")
    g, u, d = (np.asarray(getattr(moe.experts, n)[...], np.float64) for n in names)
    gb, ub, db = (np.asarray(getattr(moe.experts, f"{n}_bias")[...], np.float64)
                  if cfg.expert_bias else np.zeros((cfg.n_experts, 1)) for n in names)
    logits = tokens @ np.asarray(moe.gate.kernel[...], np.float64)
    if cfg.router_bias:
        logits = logits + np.asarray(moe.gate.bias[...], np.float64)
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    out = np.zeros_like(tokens)
    for n, (t, row) in enumerate(zip(tokens, logits)):
        if cfg.router == "softmax":
            probs = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
            chosen = np.argsort(-probs, kind="stable")[:cfg.top_k]
        else:
            probs = 1 / (1 + np.exp(-row))
            chosen = np.argsort(-within_best_groups(cfg, probs + np.asarray(
                moe.balance_bias[...])), kind="stable")[:cfg.top_k]
        weights = probs[chosen] / (probs[chosen].sum() if cfg.normalize_top_k else 1)
        for e, w in zip(chosen, weights * cfg.routed_scaling_factor):
            if (n, int(e)) not in dropped_pairs:
                out[n] += w * (expert_glu(cfg, t @ g[e] + gb[e], t @ u[e] + ub[e]) @ d[e] + db[e])
        if cfg.n_shared_experts:
            s = moe.shared_experts
            out[n] += (silu(t @ np.asarray(s.gate_proj.kernel[...])) *
                       (t @ np.asarray(s.up_proj.kernel[...]))) @ np.asarray(s.down_proj.kernel[...])
    return out.reshape(x.shape)


def expert_glu(cfg, gate, up):
    """``silu(gate) * up``; with ``swiglu_limit`` gpt-oss's, as its paper writes it."""
    if cfg.swiglu_limit is None:
        return gate / (1 + np.exp(-gate)) * up
    gate, up = np.minimum(gate, cfg.swiglu_limit), np.clip(up, -cfg.swiglu_limit,
                                                           cfg.swiglu_limit)
    return gate / (1 + np.exp(-cfg.swiglu_alpha * gate)) * (up + 1)


GPT_OSS = {"router_bias": True, "expert_bias": True, "swiglu_limit": 1.0}  # (a limit reached)


def with_random_biases(moe: MoE) -> MoE:
    """``moe`` with its router's and experts' biases (zeros at init) drawn at random."""
    for i, leaf in enumerate([moe.gate.bias] + [getattr(moe.experts, f"{n}_bias") for n in (
            "gate_proj", "up_proj", "down_proj")]):
        leaf[...] = jax.random.normal(jax.random.PRNGKey(10 + i), leaf.shape)
    return moe


def within_best_groups(cfg, biased):
    """``biased`` scores outside the ``topk_group`` groups of the largest top-2 sums at -inf."""
    groups = biased.reshape(cfg.n_group, -1)
    sums = np.sort(groups, axis=1)[:, -2:].sum(1)
    kept = np.argsort(-sums, kind="stable")[:cfg.topk_group]
    return np.where(np.isin(np.arange(cfg.n_group), kept)[:, None], groups, -np.inf).reshape(-1)


def block(seed=0, **overrides):
    cfg = MoEConfig(**{**dict(hidden_size=16, n_experts=6, top_k=2, expert_size=24), **overrides})
    return MoE(cfg, nnx.Rngs(seed))


X = jax.random.normal(jax.random.PRNGKey(1), (3, 7, 16))


@pytest.mark.parametrize("overrides", [
    {}, {"top_k": 1}, {"normalize_top_k": False},
    {"router": "sigmoid", "routed_scaling_factor": 2.5, "n_shared_experts": 2},
    {"router": "sigmoid", "n_group": 3, "topk_group": 1}, GPT_OSS])
def test_dropless_equals_each_token_through_its_experts(overrides):
    moe = block(**overrides)
    if moe.cfg.router == "sigmoid":  # a bias that changes which experts are chosen
        moe.balance_bias[...] = jnp.linspace(-0.3, 0.3, moe.cfg.n_experts)
    if moe.cfg.expert_bias:
        with_random_biases(moe)
    y, aux = moe(X)
    np.testing.assert_allclose(np.asarray(y), reference(moe, X), rtol=2e-4, atol=2e-5)
    assert float(aux["dropped_share"]) == 0 and float(aux["expert_load"].sum()) == 21 * moe.cfg.top_k


@pytest.mark.parametrize("overrides", [{}, GPT_OSS])
def test_a_large_enough_capacity_changes_nothing_and_a_small_one_drops_later_choices(overrides):
    """A dropped pair adds nothing to its token (gpt-oss: not its expert's output bias either)."""
    biased = with_random_biases if overrides else (lambda moe: moe)
    dropless = biased(block(**overrides))
    y, _ = dropless(X)
    roomy = biased(block(capacity_factor=float(dropless.cfg.n_experts), **overrides))
    np.testing.assert_allclose(np.asarray(roomy(X)[0]), np.asarray(y), rtol=1e-5, atol=1e-6)
    tight = biased(block(capacity_factor=0.5, **overrides))  # 21 x 2 / 6 x 0.5: 4 pairs each
    capacity = tight.cfg.capacity(21)
    y_tight, aux = tight(X)
    chosen = np.asarray(tight.route(X.reshape(-1, 16))[0])
    taken, dropped = {e: 0 for e in range(6)}, set()
    for k in range(2):  # first choices first, in token order, then second choices
        for n in range(21):
            e = int(chosen[n, k])
            if taken[e] < capacity:
                taken[e] += 1
            else:
                dropped.add((n, e))
    assert capacity == 4 and dropped, "the test needs some pairs over capacity"
    np.testing.assert_allclose(np.asarray(y_tight), reference(tight, X, dropped), rtol=2e-4,
                               atol=2e-5)
    assert float(aux["dropped_share"]) == pytest.approx(len(dropped) / 42)


@pytest.mark.parametrize("capacity_factor", [None, 1.5])
def test_gradients_equal_the_dense_computation(capacity_factor):
    """Gradients of a loss with respect to every expert and the router: the block against the
    same routing written as a dense sum over all experts with zero weight off the top-k."""
    moe = block(capacity_factor=capacity_factor, n_shared_experts=1)
    graphdef, params, rest = nnx.split(moe, nnx.Param, ...)

    def loss(params, dense):
        m = nnx.merge(graphdef, params, rest)
        if not dense:
            y, aux = m(X)
            return jnp.sum(jnp.sin(y)) + aux["aux_loss"]
        tokens = X.reshape(-1, 16)
        chosen, weights, _, _ = m.route(tokens)
        gate = jnp.zeros((21, 6)).at[jnp.arange(21)[:, None], chosen].set(weights)
        ex = m.experts
        per = jax.vmap(lambda g, u, d: (jax.nn.silu(tokens @ g) * (tokens @ u)) @ d)(
            ex.gate_proj[...], ex.up_proj[...], ex.down_proj[...])  # (E, N, H)
        y = jnp.einsum("ne,enh->nh", gate, per) + m.shared_experts(tokens)
        return jnp.sum(jnp.sin(y.reshape(X.shape))) + m(X)[1]["aux_loss"]
    if capacity_factor is not None:
        assert float(moe(X)[1]["dropped_share"]) == 0  # 1.5x: nothing dropped on this input
    grad = jax.jit(jax.grad(loss), static_argnums=1)
    got, want = grad(params, False), grad(params, True)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    assert any(float(jnp.abs(a).max()) > 0 for a in jax.tree.leaves(got["gate"]))


def test_the_sigmoid_choice_gives_the_scores_their_gradient_and_the_bias_its_load_sign():
    """Backward through the choice: the scores get the gradient of picking the chosen ones (the
    choice held fixed); the bias gets ``sign(load - mean load)``, whatever the loss."""
    scores = jax.nn.sigmoid(jax.random.normal(jax.random.PRNGKey(2), (21, 6)))
    bias = jnp.linspace(-0.2, 0.2, 6)
    weights, chosen = sigmoid_choice(scores, bias, 2, 3, 2)
    fixed = jax.grad(lambda s: jnp.sum(jnp.sin(jnp.take_along_axis(s, chosen, -1))))(scores)
    np.testing.assert_allclose(jax.grad(lambda s: jnp.sum(jnp.sin(
        sigmoid_choice(s, bias, 2, 3, 2)[0])))(scores), fixed, rtol=1e-6)
    load = np.bincount(np.asarray(chosen).reshape(-1), minlength=6)
    for loss in (jnp.sum, lambda w: -3 * jnp.sum(w ** 2)):
        np.testing.assert_array_equal(jax.grad(lambda b: loss(sigmoid_choice(
            scores, b, 2, 3, 2)[0]))(bias), np.sign(load - load.mean()))


def test_the_auxiliary_losses_at_balance_and_at_collapse():
    moe = block(top_k=1, z_loss_weight=1e-3)
    moe.gate.kernel[...] = jnp.zeros_like(moe.gate.kernel[...])  # every expert equally likely
    tokens = jnp.eye(16)[:12] * 0  # 12 tokens; top_k of ties: expert 0 for all
    _, aux = moe(tokens)
    assert float(aux["load_balancing_loss"]) == pytest.approx(1.0)  # P uniform: 6 * (1 * 1/6)
    assert float(aux["router_z_loss"]) == pytest.approx(np.log(6) ** 2, rel=1e-5)
    assert float(aux["load_max"]) == 12 and float(aux["load_min"]) == 0
    moe.gate.kernel[...] = jnp.zeros_like(moe.gate.kernel[...]).at[:, 0].set(50.0)
    _, collapsed = moe(jnp.ones((12, 16)))  # every token sure of expert 0
    assert float(collapsed["load_balancing_loss"]) == pytest.approx(6.0, rel=1e-4)
    assert float(collapsed["aux_loss"]) == pytest.approx(
        0.01 * float(collapsed["load_balancing_loss"]) + 1e-3 * float(collapsed["router_z_loss"]))


def test_the_balancing_bias_moves_against_the_load_until_it_evens_out():
    moe = block(router="sigmoid", top_k=1, n_experts=4)
    moe.gate.kernel[...] = moe.gate.kernel[...].at[:, 0].add(0.5)  # expert 0 favoured
    x = jax.random.normal(jax.random.PRNGKey(3), (256, 16))
    graphdef, bias, rest = nnx.split(moe, BalanceBias, ...)

    @jax.jit
    def balanced(bias, _):  # one step: the load with this bias, then the bias moved
        aux = nnx.merge(graphdef, bias, rest)(x)[1]
        moved = jax.tree.map(lambda b: updated_balance_bias(b, aux["expert_load"], 0.01), bias)
        return moved, aux["load_cv"]
    bias, cvs = jax.lax.scan(balanced, bias, None, length=300)
    nnx.update(moe, bias)
    bias = np.asarray(moe.balance_bias[...])
    assert bias[0] == bias.min() < 0, bias  # the favoured expert is held back most
    assert cvs[-1] < 0.25 * cvs[0], (cvs[0], cvs[-1])
    np.testing.assert_array_equal(np.asarray(updated_balance_bias(jnp.zeros(3), jnp.array(
        [5.0, 1.0, 3.0]), 0.1)), np.array([-0.1, 0.1, 0.0], np.float32))


@pytest.mark.parametrize("bad, match", [
    ({"router": "relu"}, "router='relu'"), ({"top_k": 7}, "top_k=7 with n_experts=6"),
    ({"capacity_factor": 0.0}, "capacity_factor=0.0"),
    ({"router": "top_k_sigmoid", "expert_input_scaled": True, "capacity_factor": 1.0},
     "expert_input_scaled \\(Llama 4\\) runs dropless only")])
def test_a_bad_config_is_refused_naming_the_field(bad, match):
    with pytest.raises(ValueError, match=match):
        block(**bad)


def test_an_moe_models_loss_with_labels_adds_its_weighted_balancing_losses():
    """Qwen3-MoE (two sparse layers, one dense): given labels, the loss is the cross-entropy of
    its logits plus ``router_aux_loss_coef`` times the blocks' balancing losses, linear in the
    coefficient; and the router's gradient feels it."""
    import dataclasses

    import optax

    from redco_zoo_models import LlamaForCausalLM
    from redco_zoo_models.toy import tiny_family
    base = tiny_family("qwen3-moe")
    ids = jnp.asarray(np.random.RandomState(0).randint(1, 63, (2, 12)))

    def split(coef):
        model = LlamaForCausalLM(dataclasses.replace(base.cfg, router_aux_loss_coef=coef),
                                 nnx.Rngs(0))
        nnx.update(model, nnx.state(base, nnx.Param))
        return nnx.split(model, nnx.Param, ...)

    def loss_and_router_grad(coef):  # one compiled program per coefficient, not op by op
        graphdef, params, rest = split(coef)
        loss = lambda p: nnx.merge(graphdef, p, rest)(ids[:, :-1], labels=ids[:, 1:])  # noqa: E731
        value, grad = jax.jit(jax.value_and_grad(loss))(params)
        return float(value), first_layer_with(grad["model"]["layers"], "mlp/gate")[0]["kernel"][...]
    logits = nnx.jit(lambda model, x: model(x))(base, ids)[:, :-1]
    cross_entropy = float(optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean())
    losses, routers = {}, {}
    for coef in (0.0, 0.5, 1.0):
        losses[coef], routers[coef] = loss_and_router_grad(coef)
    assert losses[0.0] == pytest.approx(cross_entropy, rel=1e-5)
    balancing = losses[1.0] - losses[0.0]
    assert balancing > 1.5  # two sparse layers, each about 1 (2 at most here)
    assert losses[0.5] - losses[0.0] == pytest.approx(0.5 * balancing, rel=1e-4)
    assert float(jnp.abs(routers[1.0] - routers[0.0]).max()) > 1e-4


def test_the_lm_and_sft_loss_fns_add_the_balancing_losses_and_return_the_experts_metrics():
    """``redco zoo run lm`` and ``sft`` compute their loss from logits, which carry no balancing
    loss: through ``return_metrics`` an MoE model's loss is what its ``labels=`` loss is (the
    cross-entropy plus ``router_aux_loss_coef`` times the balancing losses), with the experts'
    load logged beside it; a dense model's is its plain loss."""
    from redco.train_step import TrainState
    from redco_zoo_lm.pipeline import loss_fn as lm_loss
    from redco_zoo_models import split_model
    from redco_zoo_models.toy import tiny_family
    from redco_zoo_sft.pipeline import loss_fn as sft_loss
    ids = np.random.RandomState(0).randint(1, 63, (2, 13)).astype(np.int32)
    batch = {"input_ids": ids, "segment_ids": np.ones_like(ids),
             "loss_mask": np.ones(ids.shape, bool)}
    for family, sparse in (("qwen3-moe", True), ("qwen3", False)):
        model = tiny_family(family)
        apply_fn, params = split_model(model)
        state = TrainState(step=0, params=params, opt_state=None, rng=None, apply_fn=apply_fn)
        labelled = float(model(ids[:, :-1], labels=ids[:, 1:]))
        for loss_fn in (lm_loss, sft_loss):
            out = loss_fn(None, state, params, batch, True)
            assert isinstance(out, tuple) == sparse, (family, loss_fn.__module__)
            loss, metrics = out if sparse else (out, {})
            assert float(loss) == pytest.approx(labelled, rel=1e-5), (family, loss_fn.__module__)
            if sparse:
                assert set(metrics) >= {"moe/aux_loss", "moe/load_balancing_loss",
                                        "moe/router_z_loss", "moe/load_cv", "moe/load_cv_max",
                                        "moe/dropped_share"}
                assert float(metrics["moe/aux_loss"]) > 0
                assert float(metrics["moe/load_cv_max"]) >= float(metrics["moe/load_cv"])


def test_sft_then_grpo_train_a_tiny_moe_and_log_its_router(tmp_path):
    """Post-training reaches MoE models: ``redco zoo run sft`` and then ``grpo`` (its rollouts on
    the engine) train a tiny Qwen3-MoE end to end, each update's loss carrying the balancing
    losses and the router's state logged beside it (expert load CV, dropped share): router
    collapse would show there."""
    import json

    from post_training_task import WORDS, write_task

    from redco.cli import main
    from redco_zoo_models.toy import save_tiny_chat_model
    write_task(tmp_path)
    save_tiny_chat_model(str(tmp_path / "moe-chat"), WORDS, family="qwen3-moe",
                         num_hidden_layers=1)  # (one sparse layer: one MoE block's router)
    main(["zoo", "run", "sft", "--model", str(tmp_path / "moe-chat"), "--train",
          str(tmp_path / "chats.jsonl"), "--workdir", str(tmp_path / "sft"), "--max_len", "16",
          "--per_device_batch_size", "2", "--max_steps", "3", "--learning_rate", "3e-3"])
    main(["zoo", "run", "grpo", "--model", str(tmp_path / "sft" / "model"), "--train",
          str(tmp_path / "prompts.jsonl"), "--workdir", str(tmp_path / "grpo"),
          "--n_rounds", "1", "--max_new_tokens", "4", "--max_prompt_len", "16",
          "--prompts_per_round", "8", "--n_samples", "2", "--per_device_batch_size", "2"])
    for stage in ("sft", "grpo"):
        with open(tmp_path / stage / "metrics.jsonl") as f:
            updates = [row for row in map(json.loads, f) if "train/loss" in row]
        assert updates, stage
        for row in updates:
            assert np.isfinite(row["train/loss"]) and row["moe/aux_loss"] > 0, (stage, row)
            if stage == "sft":  # (a cross-entropy, so at least the balancing losses added)
                assert row["train/loss"] > row["moe/aux_loss"], row
            assert 0 <= row["moe/load_cv"] <= row["moe/load_cv_max"], (stage, row)
            assert row["moe/dropped_share"] == 0, (stage, row)  # dropless


class Favouring:
    """A ``Trainer`` plugin keeping the params after each step and the step's load CV."""

    def __init__(self):
        self.params, self.load_cv = [], []

    @redco.hookimpl
    def on_step_end(self, trainer, step, metrics):
        self.params.append(jax.device_get(trainer.params))
        self.load_cv.append(float(metrics["load_cv"]))


def test_trainer_fit_moves_the_balancing_bias_by_each_steps_load_outside_the_optimizer():
    """A sigmoid-routed block, expert 0 favoured, trained by ``Trainer.fit`` with AdamW (weight
    decay 0.5) through ``moe_optimizer``: after every step the bias is exactly DeepSeek-V3's
    update of the step's load (``updated_balance_bias``: no decay, no Adam moments on it), the
    favoured expert's bias ends lowest, and the load evens out over the run."""
    rate = 0.02
    model = block(router="sigmoid", top_k=1, n_experts=4, bias_update_rate=rate)
    model.gate.kernel[...] = model.gate.kernel[...].at[:, 0].add(0.5)
    x = np.random.RandomState(0).normal(size=(64, 16)).astype(np.float32)
    examples = [{"x": r, "y": np.tanh(r[::-1])} for r in x]  # one global batch of 8 x 8
    apply_fn, params = split_model(model)

    def loss_fn(rng, state, params, batch, is_training):
        y, aux = state.apply_fn(params, batch["x"])
        return jnp.mean((y - batch["y"]) ** 2), {"load_cv": aux["load_cv"]}
    collate = lambda rows: {k: np.stack([r[k] for r in rows]) for k in rows[0]}  # noqa: E731
    recorder = Favouring()
    trainer = Trainer(Deployer(jax_seed=0, workdir=None, verbose=False), collate, apply_fn,
                      loss_fn, params, moe_optimizer(optax.adamw(1e-2, weight_decay=0.5), model),
                      callbacks=[recorder])
    trainer.fit(examples, per_device_batch_size=8, max_steps=25, eval_sanity_check=False)
    load_at = jax.jit(lambda p: apply_fn(p, jnp.asarray(x))[1]["expert_load"])
    for before, after in zip([params, *recorder.params], recorder.params):
        bias = before["balance_bias"][...]
        np.testing.assert_allclose(after["balance_bias"][...], updated_balance_bias(
            bias, load_at(before), rate), atol=1e-7)
        assert np.abs(after["gate"]["kernel"][...] - before["gate"]["kernel"][...]).max() > 0
    bias = recorder.params[-1]["balance_bias"][...]
    assert bias[0] == bias.min() < 0, bias
    assert np.mean(recorder.load_cv[-10:]) < 0.5 * recorder.load_cv[0], recorder.load_cv
