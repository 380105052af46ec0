"""GRPO: tokens after EOS count for nothing, the three loss averages are what they say, the clip
fraction counts the tokens it should, the KL penalty's gradient is the one GRPO means, bad
rewards and prompts are refused before any update, and sharded dp 4 x mp 2 it samples and trains
as at dp 8 (one run in this process, never stopped, shared: what the stopped and killed runs
resume to). (That it learns, after SFT, is ``test_post_training.py``.)"""
import dataclasses
import functools
import json
import os
import random
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from post_training_task import WORDS, write_task
from test_sft import SPECIALS, chat_tokenizer

from redco.cli import main
from redco.protocols import UsageError
from redco_zoo_grpo import loss_fn
from redco_zoo_grpo.loss import average, clip_fraction, group_advantages, token_logps, token_losses
from redco_zoo_grpo.pipeline import check_context
from redco_zoo_grpo.rewards import exact_match, score
from redco_zoo_grpo.rollout import completion_mask
from redco_zoo_sft.chat import render_prompt

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kill_anywhere import kill_at_random, said_resumed  # noqa: E402

EOS = SPECIALS.index("<|im_end|>")
HERE = os.path.dirname(os.path.abspath(__file__))


class LogitsAreParams:  # a "model" whose logits are its params: (B, T, V) for ids (B, T)
    apply_fn = staticmethod(lambda params, ids, segment_ids: params[:, :ids.shape[1]])


def a_batch(tokens, advantage):
    tokens = np.asarray(tokens, np.int32)
    return {"prompt_ids": np.full((len(tokens), 3), 7, np.int32),
            "prompt_mask": np.ones((len(tokens), 3), bool), "tokens": tokens,
            "completion_mask": completion_mask(tokens, EOS),
            "advantage": np.asarray(advantage, np.float32)}


def test_tokens_after_eos_count_for_nothing():
    tokens = [[9, 12, EOS, 0, 0], [5, EOS, 0, 0, 0]]
    batch = a_batch(tokens, [1.0, -1.0])
    assert batch["completion_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]
    logits = jax.random.normal(jax.random.PRNGKey(0), (2, 7, len(SPECIALS) + len(WORDS)))
    batch["old_logps"] = token_logps(LogitsAreParams.apply_fn, logits, batch, 1.0)  # ratio 1
    def value_and_grad(batch):
        return jax.value_and_grad(lambda p: loss_fn(None, LogitsAreParams, p, batch, True,
                                                    loss_type="dapo"))(logits)
    loss, grad = value_and_grad(batch)
    garbage = np.array([[9, 12, EOS, 30, 31], [5, EOS, 20, 21, 22]])
    changed_loss, changed_grad = value_and_grad(dict(batch, tokens=garbage))
    assert float(loss) != 0 and float(changed_loss) == float(loss)
    np.testing.assert_array_equal(changed_grad, grad)
    counted = np.abs(np.asarray(grad)).sum(-1)[:, 2:] > 0  # the logits predicting each token
    assert counted.tolist() == batch["completion_mask"].tolist()


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_one_step_raises_the_log_probabilities_of_an_advantaged_completion(loss_type):
    """One gradient step on the loss: the tokens of the completion with a positive advantage
    become likelier, those of the one with a negative advantage less likely."""
    batch = a_batch([[9, 12, 14, EOS], [5, 6, 7, EOS]], [1.0, -1.0])
    logits = jax.random.normal(jax.random.PRNGKey(1), (2, 7, len(SPECIALS) + len(WORDS)))
    logps = lambda p: token_logps(LogitsAreParams.apply_fn, p, batch, 1.0)
    batch["old_logps"] = logps(logits)
    grad = jax.grad(lambda p: loss_fn(None, LogitsAreParams, p, batch, True,
                                      loss_type=loss_type))(logits)
    change = np.asarray(logps(logits - 0.1 * grad) - batch["old_logps"])
    assert (change[0] > 0).all() and (change[1] < 0).all(), change


def test_the_three_averages_weigh_tokens_as_their_variants_define():
    per_token = jnp.array([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    mask = jnp.array([[1, 1, 1, 1], [1, 0, 0, 0]])
    assert float(average(per_token, mask, "grpo")) == pytest.approx((1 + 4) / 2)  # per sequence
    assert float(average(per_token, mask, "dapo")) == pytest.approx(8 / 5)  # per token
    assert float(average(per_token, mask, "dr_grpo")) == pytest.approx(8 / 8)  # constant
    rewards = np.array([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    np.testing.assert_allclose(group_advantages(rewards, "dr_grpo"),
                               [[0.75, -0.25, -0.25, -0.25], [0, 0, 0, 0]])
    grpo = group_advantages(rewards, "grpo")
    assert grpo[0, 0] == pytest.approx(0.75 / np.std([1, 0, 0, 0]), rel=1e-3)
    assert not grpo[1].any()  # a group all alike teaches nothing


def test_the_clip_fraction_counts_masked_in_tokens_outside_the_asymmetric_clip_range():
    """Ratios against old log-probabilities that are not 0, DAPO's clip-higher range [0.8, 1.28]:
    0.79 and 1.3 are outside, 1.1 and 1.0 inside, 0.5 outside, the masked-out 2.0 counts for
    nothing; 3 of the 7 counted tokens, not the mean of each row's share (5 / 12)."""
    ratios = np.array([[0.79, 1.0, 1.3, 1.1], [0.5, 1.0, 1.0, 2.0]])
    mask = np.array([[1, 1, 1, 1], [1, 1, 1, 0]], bool)
    old = np.full(ratios.shape, -1.5)
    assert clip_fraction(old + np.log(ratios), old, mask, 0.2, 0.28) == pytest.approx(3 / 7)
    # swapped bounds ([0.72, 1.2]) or the ratio inverted would count 2 of 7, the mask ignored 4 of 8
    assert clip_fraction(old, old, mask, 0.2, 0.28) == 0.0  # the first update's ratio: 1


def test_the_kl_penalty_pulls_along_kl_policy_to_reference_and_k3_would_not():
    """Over a policy's own samples (exactly: every token weighed by its probability), the
    gradient of the loss's k2 penalty is the gradient of KL(policy || reference); DeepSeek's k3
    used as a loss gives that of KL(reference || policy) instead (``loss.py``'s docstring)."""
    theta, ref = jax.random.normal(jax.random.PRNGKey(0), (2, 6))
    tokens = jnp.arange(6)[:, None]
    log_ref = jax.nn.log_softmax(ref)[tokens]
    def expected(per_token_fn):
        def loss(theta):
            logps = jax.nn.log_softmax(theta)[tokens]
            weights = jax.lax.stop_gradient(jnp.exp(logps))  # the samples' probabilities
            return jnp.sum(weights * per_token_fn(logps))
        return jax.grad(loss)(theta)
    def k2_penalty(logps):
        batch = {"old_logps": jax.lax.stop_gradient(logps), "advantage": jnp.zeros(6),
                 "ref_logps": log_ref}
        return token_losses(logps, batch, 0.2, 0.2, beta=1.0)
    def k3(logps):
        return jnp.exp(log_ref - logps) - (log_ref - logps) - 1
    def kl(p_logits, q_logits):
        p = jax.nn.log_softmax(p_logits)
        return jnp.sum(jnp.exp(p) * (p - jax.nn.log_softmax(q_logits)))
    reverse, forward = jax.grad(kl)(theta, ref), jax.grad(lambda t: kl(ref, t))(theta)
    np.testing.assert_allclose(expected(k2_penalty), reverse, atol=1e-6)
    np.testing.assert_allclose(expected(k3), forward, atol=1e-6)
    assert not np.allclose(reverse, forward, atol=1e-3)


def test_prompts_and_completions_beyond_a_models_positions_are_refused():
    from flax import nnx

    from redco_zoo_models.gpt2 import GPT2Config, GPT2LMHeadModel
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=32, n_embd=16, n_layer=1,
                                      n_head=2), nnx.Rngs(0))
    check_context(gpt2, 24, 8)  # fits exactly
    with pytest.raises(UsageError, match=r"longest prompt \(24 tokens\) plus --max_new_tokens 9 "
                                         r"exceeds the model's 32 positions"):
        check_context(gpt2, 24, 9)


def test_a_reward_function_of_the_wrong_shape_stops_the_run_before_any_update(
        warmed_up, tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def one_for_all(prompts, completions, **columns):\n    return [1.0]\n")
    monkeypatch.setenv("REDCO_DEBUG", "1")
    with pytest.raises(UsageError, match=r"one_for_all returned shape \(1,\) for \d+ completions "
                                         r"of the greedy completions"):
        main(["zoo", "run", "grpo", "--model", str(warmed_up / "sft" / "model"), "--train",
              str(warmed_up / "prompts.jsonl"), "--workdir", str(tmp_path / "run"), "--reward",
              f"{tmp_path / 'my_rewards.py'}:one_for_all", "--per_device_batch_size", "4",
              "--n_rounds", "2", *GRPO_FLAGS])
    assert not (tmp_path / "run" / "model").exists()
    metrics = (tmp_path / "run" / "metrics.jsonl")
    assert not metrics.exists() or "train/loss" not in metrics.read_text()  # no update ran


def test_a_bad_reward_or_prompt_is_refused_naming_it():
    prompts, completions = ["p0", "p1"], ["y1", "y2"]
    assert score(exact_match, prompts, completions, {"answer": ["y1", "y3"]},
                 "round 1").tolist() == [1.0, 0.0]
    def one(prompts, completions, **_):
        return [1.0]
    with pytest.raises(UsageError, match=r"one returned shape \(1,\) for 2 completions of round "
                                         r"3: return a list of 2 numbers"):
        score(one, prompts, completions, {}, "round 3")
    def nan(prompts, completions, **_):
        return [0.0, float("nan")]
    with pytest.raises(UsageError, match=r"nan returned nan for completion 1 of round 1 \('y2' "
                                         r"after prompt 'p1'\): return a finite number"):
        score(nan, prompts, completions, {}, "round 1")
    with pytest.raises(UsageError, match=r"--train row 4 is 11 tokens once rendered, longer "
                                         r"than --max_prompt_len 8"):
        render_prompt(chat_tokenizer(), "x1 x2 x3 x4 x5 x6", 8, "--train row 4")
    with pytest.raises(UsageError, match="no chat template"):
        render_prompt(chat_tokenizer(template=None), "x1", 8)


GRPO_FLAGS = ["--max_new_tokens", "4", "--max_prompt_len", "16", "--prompts_per_round", "16",
              "--n_samples", "16", "--learning_rate", "5e-4"]


@pytest.fixture(scope="module")
def warmed_up(tmp_path_factory):
    """The README's task (``test_post_training.write_task``) and its model after the SFT
    warm-up, in ``root/sft/model``: warmed up once a session for the modules that import this
    fixture (``test_grpo_async.py`` too), which only read it."""
    return warm_up(tmp_path_factory.getbasetemp())


@functools.cache
def warm_up(basetemp):
    root = basetemp / "grpo-warmed-up"
    root.mkdir()
    write_task(root, seed=0)
    main(["zoo", "run", "sft", "--model", str(root / "tiny-chat"), "--train",
          str(root / "chats.jsonl"),
          "--workdir", str(root / "sft"), "--max_len", "16", "--per_device_batch_size", "2",
          "--n_epochs", "4", "--learning_rate", "3e-3"])
    return root


@pytest.mark.parametrize("engine_rows", [0, 8])
def test_a_rollouts_samples_count_their_completion_up_to_its_first_eos(warmed_up, tmp_path,
                                                                       engine_rows):
    """Real rollouts of the warmed-up model (answers of ~2 tokens in 6 new tokens): each sample
    counts its completion up to and including its first EOS and nothing after, the logged
    completion length is what the samples count, and the clip fraction reuses the scorer's
    compiled program."""
    import optax

    from redco import Deployer, Trainer
    from redco_zoo_grpo.pipeline import collate_fn, pred_fn, prompt_examples
    from redco_zoo_grpo.rollout import GRPO, GRPOConfig
    from redco_zoo_models import runner, split_model
    from redco_zoo_sft.pipeline import load_chat_tokenizer
    model_dir = str(warmed_up / "sft" / "model")
    tokenizer, (model, _) = load_chat_tokenizer(model_dir), runner.load_model(model_dir, False, 0)
    with open(warmed_up / "prompts.jsonl") as f:
        rows = [json.loads(line) for line in f][:8]
    (prompts, rows), _ = prompt_examples(tokenizer, (rows, rows[:1]), "prompt", 16)
    deployer = Deployer(jax_seed=0, workdir=str(tmp_path), verbose=False)
    apply_fn, params = split_model(model)
    trainer = Trainer(deployer, collate_fn, apply_fn, loss_fn, params, optax.sgd(0.0))
    grpo = GRPO(trainer, model, tokenizer, pred_fn, exact_match,
                GRPOConfig(n_samples=4, max_new_tokens=6), per_device_batch_size=4,
                engine_rows=engine_rows)
    grpo.decide_layout(prompts, 0)
    samples, metrics = grpo.rollout(prompts, rows, "prompt", 1)
    ended_early = 0
    for sample in samples:
        tokens, mask = sample["tokens"], sample["completion_mask"]
        end = list(tokens).index(grpo.eos_id) + 1 if grpo.eos_id in tokens else len(tokens)
        assert mask.tolist() == [True] * end + [False] * (len(tokens) - end), (tokens, mask)
        ended_early += end < len(tokens)
    assert ended_early >= len(samples) // 2, ended_early  # so padding was there to count
    assert metrics["completion_tokens"] == np.mean([s["completion_mask"].sum() for s in samples])
    # without a reference, the clip fraction's pass is the scoring program, compiled once
    assert grpo.rescorer is grpo.scorer
    assert grpo.clip_fraction(samples) == 0.0  # no update yet: every ratio exactly 1
    assert grpo.scorer._pred_step._cache_size() == 1


def a_dapo_grpo(warmed_up, tmp_path, asynchronous=None):
    """A GRPO loop over the warmed-up model (no updates) and the first 8 prompts, every other
    marked "dead": its reward 1 for every completion (no signal), the others' alternate 0, 1
    within each group (signal). With ``asynchronous`` (an ``AsyncConfig``): on the engine,
    its rollouts on the devices that leaves (``test_grpo_async.py``)."""
    import optax

    from redco import Deployer, Trainer
    from redco_zoo_grpo.pipeline import collate_fn, pred_fn, prompt_examples
    from redco_zoo_grpo.rollout import GRPO, GRPOConfig
    from redco_zoo_models import runner, split_model
    from redco_zoo_sft.pipeline import load_chat_tokenizer
    model_dir = str(warmed_up / "sft" / "model")
    tokenizer, (model, _) = load_chat_tokenizer(model_dir), runner.load_model(model_dir, False, 0)
    with open(warmed_up / "prompts.jsonl") as f:
        rows = [dict(json.loads(line), dead=dead) for line, dead in
                zip(f, [True, False, True, True, False, False, True, False])]
    (prompts, rows), _ = prompt_examples(tokenizer, (rows, rows[:1]), "prompt", 16)
    def reward(prompts, completions, dead, **_):
        return [1.0 if d else float(i % 2) for i, d in enumerate(dead)]
    from redco_zoo_grpo.async_rollouts import training_devices
    split = {} if asynchronous is None else dict(
        engine_rows=16, decode_model_shards=1, asynchronous=asynchronous)
    deployer = Deployer(jax_seed=0, workdir=str(tmp_path), verbose=False, devices=None if
                        asynchronous is None else training_devices(asynchronous.rollout_devices))
    apply_fn, params = split_model(model)
    trainer = Trainer(deployer, collate_fn, apply_fn, loss_fn, params, optax.sgd(0.0))
    grpo = GRPO(trainer, model, tokenizer, pred_fn, reward,
                GRPOConfig(loss_type="dapo", n_samples=4, max_new_tokens=2),
                per_device_batch_size=2, **split)
    grpo.decide_layout(prompts, 0)
    return grpo, prompts, rows


def test_dapos_dynamic_sampling_drops_the_groups_without_signal_and_draws_more(warmed_up,
                                                                                tmp_path):
    """Rounds of 4 prompts, 4 samples each: the first draw has 1 group with signal, so the next
    4 prompts are drawn (3 with signal) and the round trains exactly the 4 groups with signal, in
    the order drawn; capped at one draw, the round fills up with the first dropped groups
    (advantages 0). Overlong filtering masks out exactly the completions without an EOS."""
    grpo, prompts, rows = a_dapo_grpo(warmed_up, tmp_path)
    more = iter([(prompts[4:], rows[4:])])
    samples, metrics = grpo.rollout(prompts[:4], rows[:4], "prompt", 1, lambda: next(more))
    trained = [int(np.flatnonzero([(s["prompt_ids"] == p["prompt_ids"]).all()
                                   for p in prompts])[0]) for s in samples[::4]]
    assert trained == [1, 4, 5, 7]  # the groups with signal, dead 0, 2, 3 and 6 dropped
    assert all(s["advantage"] != 0 for s in samples)
    assert (metrics["prompts_drawn"], metrics["groups_dropped"],
            metrics["groups_kept_without_signal"]) == (8, 4, 0)
    cut = 0
    for s in samples:  # DAPO's overlong filter: a completion without an EOS counts for nothing
        ended = EOS in s["tokens"]
        expected = completion_mask(s["tokens"][None], EOS)[0] & ended
        assert s["completion_mask"].tolist() == expected.tolist(), s
        cut += not ended
    assert 0 < cut < len(samples), cut  # both kinds were there to tell apart
    assert metrics["masked_overlong"] == cut / len(samples)
    grpo.config = dataclasses.replace(grpo.config, max_sampling_draws=1)  # capped: 1 draw
    samples, metrics = grpo.rollout(prompts[:4], rows[:4], "prompt", 2,
                                    lambda: pytest.fail("drew past the cap"))
    assert [bool(s["advantage"]) for s in samples[::4]] == [False, True, False, False]
    assert (metrics["prompts_drawn"], metrics["groups_dropped"],
            metrics["groups_kept_without_signal"]) == (4, 0, 3)


LOSS_REWARDS = """
import os, signal
from redco_zoo_grpo.rewards import exact_match
calls = 0

def reward(prompts, completions, answer, **_):
    global calls
    calls += 1  # 1: the greedy evaluation before round 1; 2: round 1's first draw
    if calls == int(os.environ.get("SIGTERM_AT_CALL", 0)):
        os.kill(os.getpid(), signal.SIGTERM)
    return exact_match(prompts, completions, answer)

def tens(prompts, completions, **_):  # the answers' first digit: right more often than not
    return [float(c.strip().startswith("y1")) for c in completions]
"""


def run_loss(root, workdir, loss: str, reward: str, *flags) -> list[dict]:
    """Two rounds of ``redco zoo run grpo --loss loss`` (8 prompts x 8 samples, one minibatch)
    of the warmed-up model, a checkpoint after each; returns its metrics' rows."""
    main(["zoo", "run", "grpo", "--model", str(root / "sft" / "model"), "--train",
          str(root / "prompts.jsonl"), "--eval", str(root / "prompts_held_out.jsonl"),
          "--workdir", str(workdir), "--loss", loss, "--reward", reward,
          "--n_rounds", "2", "--per_device_batch_size", "8", "--save_every_n_steps", "1",
          *GRPO_FLAGS, "--prompts_per_round", "8", "--n_samples", "8", *flags])
    with open(workdir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_dapo_runs_its_recipe_and_resumes_to_the_same_bits(warmed_up, tmp_path, monkeypatch):
    """``--loss dapo`` with the soft overlong punishment: rounds draw more prompts while their
    groups lack signal, logging how many were drawn and dropped. A run stopped by SIGTERM in
    round 1 resumes at round 2 with the prompts the uninterrupted run drew (the prompt stream's
    position is checkpointed) and ends with its params and metrics, bit for bit."""
    from safetensors.numpy import load_file
    (tmp_path / "dapo_reward.py").write_text(LOSS_REWARDS)
    reward = f"{tmp_path / 'dapo_reward.py'}:reward"
    monkeypatch.setenv("REDCO_DEBUG", "1")
    whole = run_loss(warmed_up, tmp_path / "whole", "dapo", reward, "--overlong_buffer", "2")
    rounds = [r for r in whole if "rollout/prompts_drawn" in r]
    assert len(rounds) == 2 and rounds[0]["rollout/prompts_drawn"] > 8, rounds  # drew more
    for r in rounds:
        assert r["rollout/groups_dropped"] == r["rollout/prompts_drawn"] - 8
        assert r["rollout/overlong_penalty"] <= 0 and 0 <= r["rollout/masked_overlong"] <= 1
    monkeypatch.setenv("SIGTERM_AT_CALL", "2")
    with pytest.raises(SystemExit) as stopped:
        run_loss(warmed_up, tmp_path / "cut", "dapo", reward, "--overlong_buffer", "2")
    assert stopped.value.code == 143
    monkeypatch.delenv("SIGTERM_AT_CALL")
    cut = run_loss(warmed_up, tmp_path / "cut", "dapo", reward, "--overlong_buffer", "2")
    assert "Resumed from" in (tmp_path / "cut" / "log.txt").read_text()
    pick = lambda rows, key: [(r["step"], r[key]) for r in rows if key in r]  # noqa: E731
    for key in ("rollout/reward", "rollout/prompts_drawn", "train/loss", "eval/reward"):
        assert pick(cut, key) == pick(whole, key), key
    params = [load_file(tmp_path / name / "model" / "model.safetensors")
              for name in ("whole", "cut")]
    for name, value in params[0].items():
        np.testing.assert_array_equal(params[1][name], value, err_msg=name)


def test_gspo_runs_and_clips_its_sequence_ratio(warmed_up, tmp_path, monkeypatch):
    """``--loss gspo`` trains (two updates a round, so the second one's sequence ratios are
    off 1): its clip fraction counts completions against GSPO's tiny range."""
    monkeypatch.setenv("REDCO_DEBUG", "1")
    (tmp_path / "rewards.py").write_text(LOSS_REWARDS)
    rows = run_loss(warmed_up, tmp_path / "gspo", "gspo", f"{tmp_path / 'rewards.py'}:tens",
                    "--n_updates", "2")
    rounds = [r for r in rows if "rollout/clip_fraction" in r]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(rounds) == 2 and len(losses) == 4 and np.isfinite(losses).all(), rows
    assert all(0 < r["rollout/clip_fraction"] <= 1 for r in rounds), rounds


def test_rollouts_decode_tensor_parallel_on_the_fsdp_trainers_own_params(warmed_up, tmp_path):
    """A trainer under FSDP over 8 devices, after an update: its engine rollouts decode on
    tensor parallelism over 2 (4 replicas, no weight split over dp), with the trainer's params
    moved there and the training copy freed (no second copy), their log-probabilities those
    of the trainer's own forward pass; after the rollout the params are back on the FSDP
    shardings, unchanged, and train on."""
    import optax

    from redco import Deployer, Trainer
    from redco_zoo_grpo.pipeline import collate_fn, pred_fn, prompt_examples
    from redco_zoo_grpo.rollout import GRPO, GRPOConfig
    from redco_zoo_models import runner, split_model
    from redco_zoo_sft.pipeline import load_chat_tokenizer
    model_dir = str(warmed_up / "sft" / "model")
    tokenizer, (model, _) = load_chat_tokenizer(model_dir), runner.load_model(model_dir, False, 0)
    with open(warmed_up / "prompts.jsonl") as f:
        rows = [json.loads(line) for line in f][:8]
    (prompts, rows), _ = prompt_examples(tokenizer, (rows, rows[:1]), "prompt", 16)
    deployer = Deployer(jax_seed=0, workdir=str(tmp_path), verbose=False, sharding_rules="fsdp")
    apply_fn, params = split_model(model)
    trainer = Trainer(deployer, collate_fn, apply_fn, loss_fn, params, optax.adam(1e-3))
    grpo = GRPO(trainer, model, tokenizer, pred_fn, exact_match,
                GRPOConfig(n_samples=4, max_new_tokens=6), per_device_batch_size=4,
                engine_rows=8, decode_model_shards=2)
    grpo.decide_layout(prompts, 0)
    specs = lambda tree: [x.sharding.spec for x in jax.tree.leaves(tree)]  # noqa: E731
    fsdp_specs = specs(trainer.params)
    assert any("dp" in spec for spec in fsdp_specs)  # trained under FSDP
    samples, _ = grpo.rollout(prompts, rows, "prompt", 1)
    trainer.train_scanned(samples, 4, range(1))  # an update: params no longer as loaded
    lent = []  # the engine's params and the trainer's, seen while decoding
    run = grpo.engine.engine.run_until_done
    grpo.engine.engine.run_until_done = lambda requests: (
        lent.append((grpo.engine.engine.params, trainer.state.params)), run(requests))
    before = trainer.params
    values = jax.tree.map(np.asarray, before)
    samples, metrics = grpo.rollout(prompts, rows, "prompt", 2)
    # the sampler's log-probabilities are the trainer's forward pass's (FSDP layout)
    assert metrics["logprob_gap"] < 1e-5, metrics["logprob_gap"]
    assert metrics["completion_tokens"] > 1
    assert dict(grpo.engine.layout.mesh.shape) == {"dp": 4, "mp": 2}
    decoding, training = lent[0]
    assert not any("dp" in spec for spec in specs(decoding))  # no FSDP gathers when decoding
    assert any("mp" in spec for spec in specs(decoding))
    # not held twice: each training leaf freed once moved, or the very array decoding (shared,
    # where both layouts replicate it); the same on the way back
    pairs = list(zip(jax.tree.leaves(training), jax.tree.leaves(decoding),
                     jax.tree.leaves(trainer.params)))
    assert all(t.is_deleted() or t is d for t, d, _ in pairs)
    assert all(d.is_deleted() or d is back for _, d, back in pairs)
    assert sum(t.is_deleted() for t, _, _ in pairs) > len(pairs) // 2, "few leaves moved"
    assert specs(trainer.params) == fsdp_specs
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, trainer.params), values)
    trainer.train_scanned(samples, 4, range(1, 2))  # the compiled step takes them back


STOPPING_REWARD = """
import os, signal
from redco_zoo_grpo.rewards import exact_match
calls = 0

def reward(prompts, completions, answer, **_):
    global calls
    calls += 1  # 1: the greedy evaluation before round 1; 3: round 2's rollouts
    if calls == 3 and os.environ.get("SIGTERM_IN_ROUND_2"):
        os.kill(os.getpid(), signal.SIGTERM)
    return exact_match(prompts, completions, answer)
"""


def grpo_args(root, workdir, reward) -> list[str]:
    """``redco``'s arguments for three GRPO rounds (8 prompts x 16 samples in minibatches of 64
    over 8 devices, 2 epochs: 4 updates each) of the warmed-up model, a checkpoint every 2
    rounds."""
    return ["zoo", "run", "grpo", "--model", str(root / "sft" / "model"), "--train",
            str(root / "prompts.jsonl"), "--eval", str(root / "prompts_held_out.jsonl"),
            "--workdir", str(workdir), "--n_rounds", "3", "--reward", f"{reward}:reward",
            "--per_device_batch_size", "8", "--n_updates", "2", "--beta", "0.1",
            "--save_every_n_steps", "8", "--eval_every_n_rounds", "2", *GRPO_FLAGS,
            "--prompts_per_round", "8", "--learning_rate", "2e-3"]


def cli_cmd(args: list[str]) -> list[str]:
    """The ``redco`` run of ``args`` as a process of its own (the one a test SIGKILLs)."""
    return [sys.executable, "-m", "redco.cli", *args]


def grpo_env() -> dict:
    """A process as this one: 8 devices, matmuls at full fp32 precision, never stopped."""
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "")
                                      + " --xla_force_host_platform_device_count=8"),
               JAX_DEFAULT_MATMUL_PRECISION="highest")
    env.pop("SIGTERM_IN_ROUND_2", None)
    return env


def round_seconds(workdir) -> float:
    """A finished run's mean seconds a round (between its rounds' rollout rows in
    metrics.jsonl): the span a kill is spread over (``kill_at_random``)."""
    with open(workdir / "metrics.jsonl") as f:
        times = [row["time"] for row in map(json.loads, f) if "rollout/reward" in row]
    assert len(times) >= 2, times
    return (times[-1] - times[0]) / (len(times) - 1)


def stopped_by_sigterm_in_round_2(args: list[str], workdir, monkeypatch) -> None:
    """Run ``redco args`` in this process with ``STOPPING_REWARD`` sending SIGTERM in round 2:
    the round ends, step 8 is saved, it exits 143 and nothing is exported."""
    monkeypatch.setenv("SIGTERM_IN_ROUND_2", "1")
    with pytest.raises(SystemExit) as stopped:
        main(args)
    monkeypatch.delenv("SIGTERM_IN_ROUND_2")
    assert stopped.value.code == 143
    assert "Stopped by SIGTERM after step 8" in (workdir / "log.txt").read_text()
    assert not (workdir / "model").exists()


@pytest.fixture(scope="module")
def whole(warmed_up, tmp_path_factory):
    """``grpo_args``' run over 8 devices (dp 8), never stopped, in this process: the reference
    of the runs stopped and killed, and of the same run sharded dp 4 x mp 2. Its workdir and
    reward file."""
    return never_stopped(grpo_args, warmed_up, tmp_path_factory.mktemp("grpo_whole"))


def never_stopped(args_of, warmed_up, root):
    """``main(args_of(warmed_up, root / "whole", reward))`` with the stopping reward, asked not
    to stop: its workdir and reward file."""
    reward = root / "stopping_reward.py"
    reward.write_text(STOPPING_REWARD)
    os.environ.pop("SIGTERM_IN_ROUND_2", None)
    main(args_of(warmed_up, root / "whole", reward))
    return root / "whole", reward


def test_grpo_sharded_dp_x_mp_samples_and_trains_as_dp_alone(warmed_up, whole, tmp_path):
    """``grpo_args``' run (a KL penalty to a reference copy included) at dp 4 x mp 2,
    minibatches of 16 rows a device: the rewards, KL, clip fractions and held-out rewards of
    the run at dp 8 (8 rows a device), and its params. The learning rate peaks at 2e-3, so
    every round's 4 updates leave some tokens' ratios past the clip range and no round's clip
    fractions compared are 0 against 0 (at 5e-4 the last round's, decayed towards 0, left every
    ratio inside for some draws of the model)."""
    from safetensors.numpy import load_file
    workdir, reward = whole
    sharded = tmp_path / "sharded"
    main(grpo_args(warmed_up, sharded, reward) + ["--n_model_shards", "2",
                                                  "--per_device_batch_size", "16"])
    assert "mesh: {'dp': 4, 'mp': 2}" in (sharded / "log.txt").read_text()
    assert "mesh: {'dp': 8, 'mp': 1}" in (workdir / "log.txt").read_text()
    rows = [[json.loads(line) for line in open(w / "metrics.jsonl")] for w in (workdir, sharded)]
    pick = lambda rows, key: [r[key] for r in rows if key in r]  # noqa: E731
    for key in ("rollout/reward", "eval/reward"):
        assert pick(rows[1], key) == pick(rows[0], key), key
    np.testing.assert_allclose(pick(rows[1], "rollout/kl"), pick(rows[0], "rollout/kl"),
                               rtol=1e-3, atol=1e-7)
    np.testing.assert_allclose(pick(rows[1], "rollout/clip_fraction"),
                               pick(rows[0], "rollout/clip_fraction"), atol=0.01)
    assert pick(rows[0], "rollout/kl")[-1] > 0  # the policy did move away from the reference
    clipped = pick(rows[0], "rollout/clip_fraction")
    assert len(clipped) == 3 and all(0 < c <= 1 for c in clipped), clipped
    params = [load_file(w / "model" / "model.safetensors") for w in (workdir, sharded)]
    for name, value in params[0].items():
        np.testing.assert_allclose(params[1][name], value, rtol=1e-4, atol=1e-5, err_msg=name)


def test_a_grpo_run_shows_its_rounds_goodput_and_samples(whole):
    """The never-stopped run's log shows each round (reward, completions cut at
    max_new_tokens, clip fraction, tokens/s, updates), its goodput counts rollouts and steps,
    and its samples file holds the evaluated rounds' greedy completions with their rewards."""
    workdir, _ = whole
    shown = (workdir / "log.txt").read_text()
    assert "round 1/3: reward " in shown and "cut at max_new_tokens" in shown and \
        "clip fraction " in shown and "tokens/s), updates " in shown, shown[-2000:]
    goodput = json.loads((workdir / "goodput.json").read_text())["total"]
    assert goodput["rollout"] > 0 and goodput["steps"] > 0, goodput
    samples = [json.loads(line) for line in open(workdir / "samples.jsonl")]
    assert [s["round"] for s in samples] == [2] * 32 + [3] * 32  # 2 prompts x 16, evaluated rounds
    assert {"prompt", "completion", "reward"} <= set(samples[0])


def assert_same_run(whole, cut, keys, context: str) -> None:
    """``cut``'s metrics under ``keys`` (by step) and its exported params are ``whole``'s, bit
    for bit; a failure names ``context`` (the kill's seed) to rerun it."""
    try:
        assert_same_metrics_and_params(whole, cut, keys)
    except AssertionError as e:
        raise AssertionError(context) from e


def assert_same_metrics_and_params(whole, cut, keys) -> None:
    from safetensors.numpy import load_file
    rows = {w: [json.loads(line) for line in open(w / "metrics.jsonl")] for w in (whole, cut)}
    pick = lambda rows, key: [(r["step"], r[key]) for r in rows if key in r]  # noqa: E731
    for key in keys:
        assert pick(rows[cut], key) == pick(rows[whole], key), key
    whole_params = load_file(whole / "model" / "model.safetensors")
    cut_params = load_file(cut / "model" / "model.safetensors")
    for name, value in whole_params.items():
        np.testing.assert_array_equal(cut_params[name], value, err_msg=name)


def test_a_grpo_run_stopped_by_sigterm_or_killed_resumes_to_the_same_bits(warmed_up, whole,
                                                                           tmp_path, monkeypatch):
    """SIGTERM in round 2 (of 3): the round and its evaluation end, step 8 is saved, exit 143;
    the rerun, a process of its own, says it resumed there and is SIGKILLed at a random moment
    of round 3 (sampling, updating, evaluating or saving); the next ends with the params,
    rollout metrics, losses and held-out rewards of a run never stopped."""
    whole, reward = whole
    cut = tmp_path / "cut"
    stopped_by_sigterm_in_round_2(grpo_args(warmed_up, cut, reward), cut, monkeypatch)
    seed = int.from_bytes(os.urandom(4), "little")
    killed = kill_at_random(cli_cmd(grpo_args(warmed_up, cut, reward)), said_resumed(str(cut)),
                            round_seconds(whole), random.Random(seed), grpo_env())
    main(grpo_args(warmed_up, cut, reward))
    log = (cut / "log.txt").read_text()
    assert killed and log.count("Resumed from") == 2, (seed, killed, log[-2000:])
    assert "step_8 (step 8)" in log, log[-2000:]
    for workdir in (whole, cut):
        assert (workdir / "ckpts" / "step_12").exists()
    assert_same_run(whole, cut, ("rollout/reward", "rollout/kl", "rollout/clip_fraction",
                                 "eval/reward", "train/loss"), f"seed {seed}, killed {killed}")


def test_auto_shards_are_refused_before_anything_loads_naming_why(tmp_path, capsys):
    """The layout planner cannot pick a GRPO run's layout yet (its rounds are sized by the
    data-parallel size first): ``--n_model_shards auto`` is a one-line refusal, not a crash."""
    with pytest.raises(SystemExit):
        main(["zoo", "run", "grpo", "--model", str(tmp_path / "missing"), "--train",
              str(tmp_path / "missing.jsonl"), "--n_model_shards", "auto",
              "--workdir", str(tmp_path / "w")])
    assert "--n_model_shards auto: a GRPO run sizes its rounds" in capsys.readouterr().err


def test_a_decode_degree_that_does_not_divide_the_devices_is_refused_before_anything_loads(
        tmp_path, capsys):
    run = ["zoo", "run", "grpo", "--model", str(tmp_path / "missing"), "--train",
           str(tmp_path / "missing.jsonl"), "--workdir", str(tmp_path / "w")]
    with pytest.raises(SystemExit):
        main(run + ["--decode_model_shards", "3"])
    assert "--decode_model_shards 3 does not divide the 8 devices: use one of [1, 2, 4, 8]" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(run + ["--decode_model_shards", "0"])
    assert "'0': give auto, train or a positive integer" in capsys.readouterr().err


def test_grpo_help_offers_no_planner_flags(capsys):
    """What GRPO refuses its ``--help`` does not offer: no ``--n_model_shards auto`` (the
    pipelines the planner serves offer it); its ``--device_memory`` is the rollout split's
    (``--rollout_devices auto``), said so."""
    for name, offered in (("grpo", False), ("lm", True)):
        with pytest.raises(SystemExit):
            main(["zoo", "run", name, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "--device_memory" in text, name
        assert ("one device's memory for --rollout_devices auto" in text) is not offered, name
        assert ("or auto: the layout planner picks it" in text) is offered, name


def test_grpo_over_an_nf4_base_samples_with_the_trainers_log_probs_and_exports(warmed_up,
                                                                               tmp_path):
    """``--lora_rank 4 --quantize_base nf4 --beta 0.04`` (the reference: the adapters zeroed) at
    dp 4 x mp 2: two rounds sampled on the engine over the NF4 codes, with the
    log-probabilities the trainer recomputes (gap < 1e-4 each round), updates that move the
    adapters, and an export that is the NF4 base dequantised plus (alpha / r) B A of the saved
    adapters."""
    from safetensors.numpy import load_file

    from redco_zoo_models import quantize as q
    workdir = tmp_path / "qlora"
    main(["zoo", "run", "grpo", "--model", str(warmed_up / "sft" / "model"), "--train",
          str(warmed_up / "prompts.jsonl"), "--workdir", str(workdir), "--n_rounds", "2",
          "--n_model_shards", "2", "--per_device_batch_size", "2", "--max_new_tokens", "4",
          "--max_prompt_len", "16", "--prompts_per_round", "8", "--n_samples", "8",
          "--engine_rows", "8", "--learning_rate", "5e-3", "--lora_rank", "4",
          "--quantize_base", "nf4", "--beta", "0.04"])
    with open(workdir / "metrics.jsonl") as f:
        rows = list(map(json.loads, f))
    gaps = [r["rollout/logprob_gap"] for r in rows if "rollout/logprob_gap" in r]
    print("logprob gaps", gaps)
    assert len(gaps) == 2 and max(gaps) < 1e-4, gaps
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert losses and np.isfinite(losses).all(), losses
    name = "model.layers.1.self_attn.q_proj.weight"
    base = load_file(str(warmed_up / "sft" / "model" / "model.safetensors"))[name]
    exported = load_file(str(workdir / "model" / "model.safetensors"))[name]
    adapter = load_file(str(workdir / "adapter" / "adapter_model.safetensors"))
    a, b = (adapter[f"base_model.model.{name[:-7]}.lora_{x}.weight"] for x in "AB")
    assert np.abs(b).max() > 1e-4  # (the adapters trained)
    dequantised = np.asarray(q.dequantize(q.quantize(base.T, "nf4"), "nf4")).T
    np.testing.assert_allclose(exported, dequantised + 16.0 / 4 * b @ a, rtol=1e-5, atol=1e-6)
