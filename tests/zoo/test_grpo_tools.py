"""Multi-turn tool rollouts: the calculator parses calls and rewards final answers; environments
are a plugin kind (an unknown name refused naming the known); a trajectory keeps the exact
sampled ids plus the environment's tokens tokenised once (where re-tokenising the text would
give other ids); the loss is blind to the environment's tokens; real rollouts of a tiny model
over 8 devices call the tool and train."""
import json

import jax
import numpy as np
import pytest
from test_grpo import LogitsAreParams

from redco import plugins
from redco.cli import main
from redco.protocols import NotRegistered, UsageError
from redco_zoo_grpo import loss_fn
from redco_zoo_grpo.environments import Calculator, evaluate, load_environment
from redco_zoo_grpo.loss import token_logps
from redco_zoo_grpo.multiturn import Episode, turn_length

TAGS = ["<calc>", "</calc>", "<result>", "</result>"]


def bpe_tokenizer():
    """A BPE tokenizer whose merges make ``3+4`` one token: text the model sampled as ``3``,
    ``+``, ``4`` re-tokenises to other ids. Ids: pad 0, EOS 1, the tags 2-5, then characters."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(["<pad>", "<|im_end|>", *TAGS, *"0123456789+-*",
                                         "3+", "3+4"])}
    tokenizer = Tokenizer(models.BPE(vocab, [("3", "+"), ("3+", "4")]))
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    tokenizer.add_special_tokens([AddedToken("<|im_end|>", special=True)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>",
                                   pad_token="<pad>"), vocab


def test_the_calculator_evaluates_calls_and_rewards_only_the_right_final_answer():
    assert [evaluate(e) for e in ("3+4", " 2*(3-5) ", "-6*7", "2**10", "1/2", "__import__('os')",
                                  "3+", "4.5")] == [7, -4, -42, None, None, None, None, None]
    env = Calculator()
    env.reset({"prompt": "3+4?", "answer": 7})
    assert env.step("I will add <calc>3+4</calc>") == ("<result>7</result>", 0.0, False)
    assert env.step("<calc>3/4</calc>") == ("<result>error</result>", 0.0, False)
    assert env.step("<calc>1 <calc>2*3</calc> ") == ("<result>6</result>", 0.0, False)
    assert env.step("<calc>3+4</calc> so 7") == (None, 0.0, True)  # not a call: an answer
    assert env.step(" 7 ") == (None, 1.0, True)
    assert env.step("8") == (None, 0.0, True)
    with pytest.raises(UsageError, match=r"column 'answer'; the data's rows have only "
                                         r"\['prompt'\]"):
        env.reset({"prompt": "3+4?"})


def test_environments_are_a_plugin_kind_and_an_unknown_one_is_refused_naming_the_known():
    assert load_environment("calculator") is Calculator

    class Echo:
        stop = ""
        def reset(self, row): ...
        def step(self, text): return None, 0.0, True

    class Plugin:
        @staticmethod
        @plugins.hookimpl
        def register_environments(register):
            register("echo", Echo)
            register("broken", object)  # no stop, reset, step: refused

    plugins.pm.register(Plugin, name="test-environments")
    try:
        with pytest.warns(UserWarning, match="registers environments 'broken' without stop, "
                                             "reset, step"):
            assert load_environment("echo") is Echo
        with pytest.raises(NotRegistered, match=r"No environments named 'calculater'. "
                                                r"Available: \['calculator', 'echo'\]"):
            load_environment("calculater")
    finally:
        plugins.pm.unregister(name="test-environments")


def test_an_unknown_environment_or_turn_count_is_refused_before_anything_loads(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["zoo", "run", "grpo", "--model", str(tmp_path / "missing"), "--train",
              str(tmp_path / "missing.jsonl"), "--workdir", str(tmp_path / "w"),
              "--environment", "calculater"])
    assert "No environments named 'calculater'. Available: ['calculator']" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["zoo", "run", "grpo", "--model", str(tmp_path / "missing"), "--train",
              str(tmp_path / "missing.jsonl"), "--workdir", str(tmp_path / "w"),
              "--environment", "calculator", "--max_turns", "0"])
    assert "--max_turns 0: give 1 to 16." in capsys.readouterr().err


def python_eval(expression: str) -> str:
    """Python's value of a sampled call's ``expression`` (digits, ``+``, tags), or error."""
    try:
        return str(eval(expression, {"__builtins__": {}}))
    except Exception:
        return "error"


def an_episode():
    """A calculator episode of two model turns, sampled as ids: ``<calc>3 + 4</calc>`` (3, +, 4
    apart: not how the tokenizer writes ``3+4``) and what the sampler drew after it (dropped),
    then ``7`` and the EOS."""
    tokenizer, v = bpe_tokenizer()
    env = Calculator()
    env.reset({"answer": "7"})
    episode = Episode(env, budget=12)
    turn1 = np.array([v["<calc>"], v["3"], v["+"], v["4"], v["</calc>"], v["9"], v["9"]])
    turn2 = np.array([v["7"], 1, v["5"], v["5"], 0, 0, 0])
    logps = -np.arange(1, 8, dtype=np.float32) / 10
    for turn in (turn1, turn2):
        episode.turn(tokenizer, turn, logps, eos_id=1, max_turns=3)
    return tokenizer, episode, turn1[:5], turn2[:2]


def test_a_trajectory_is_the_sampled_ids_and_the_environments_tokens_never_retokenised():
    tokenizer, episode, said, answered = an_episode()
    result = tokenizer.encode("<result>7</result>", add_special_tokens=False)
    assert episode.tokens == [*said, *result, *answered]
    assert episode.mask == [True] * 5 + [False] * len(result) + [True] * 2
    assert episode.logps[:5] == pytest.approx([-0.1, -0.2, -0.3, -0.4, -0.5])
    assert episode.logps[5:] == pytest.approx([0.0] * len(result) + [-0.1, -0.2])
    assert (episode.done, episode.reward, episode.turns) == (True, 1.0, 2)
    text = tokenizer.decode(episode.tokens)
    retokenised = tokenizer.encode(text, add_special_tokens=False)
    assert retokenised != episode.tokens and len(retokenised) == len(episode.tokens) - 2  # 3+4
    tokens, logps, mask = episode.arrays(pad_id=0)
    assert tokens.tolist() == episode.tokens + [0] * 2 and mask.sum() == 7 and len(logps) == 12


def test_a_turn_stops_at_the_token_completing_the_tool_calls_end_tag_or_at_its_eos():
    tokenizer, v = bpe_tokenizer()
    ids = np.array([v["3"], v["</calc>"], 1, v["4"]])
    assert turn_length(tokenizer, ids, 1, "</calc>") == 2
    assert turn_length(tokenizer, ids, 1, "") == 3
    assert turn_length(tokenizer, np.array([v["3"], v["4"]]), 1, "</calc>") == 2


def test_the_loss_is_blind_to_the_environments_tokens():
    """With logits that are parameters, the loss's gradient is zero on every logit predicting an
    environment token and non-zero on every model token's; perturbing those logits leaves the
    loss as it was."""
    _, episode, _, _ = an_episode()
    tokens, _, mask = episode.arrays(pad_id=0)
    batch = {"prompt_ids": np.full((1, 3), 7, np.int32), "prompt_mask": np.ones((1, 3), bool),
             "tokens": tokens[None], "completion_mask": mask[None],
             "advantage": np.ones(1, np.float32)}
    logits = jax.random.normal(jax.random.PRNGKey(0), (1, 3 + 11, 24))
    batch["old_logps"] = np.asarray(token_logps(LogitsAreParams.apply_fn, logits, batch, 1.0))
    def value_and_grad(logits):
        return jax.value_and_grad(lambda p: loss_fn(None, LogitsAreParams, p, batch, True))(logits)
    loss, grad = value_and_grad(logits)
    touched = np.abs(np.asarray(grad)).sum(-1)[0, 2:] > 0  # the logits predicting each token
    # <calc> 3 + 4 </calc>, then <result> 7 </result> (the environment's), 7 EOS, padding
    assert touched.tolist() == [True] * 5 + [False] * 3 + [True] * 2 + [False] * 2
    moved = logits.at[0, 2 + 5:2 + 8].add(5.0 * jax.random.normal(jax.random.PRNGKey(1), (3, 24)))
    assert float(value_and_grad(moved)[0]) == pytest.approx(float(loss), abs=1e-6)


def calculator_grpo(tmp_path, make_env, learning_rate: float, **config):
    """A multi-turn GRPO loop (up to 3 turns) over a tiny random Llama on 8 devices, whose word
    tokenizer knows the tags, digits and ``+``; 8 prompts "a + b", their sums as ``answer``."""
    import optax

    from redco import Deployer, Trainer
    from redco_zoo_grpo.multiturn import MultiTurnGRPO
    from redco_zoo_grpo.pipeline import collate_fn, pred_fn, prompt_examples
    from redco_zoo_grpo.rollout import GRPOConfig
    from redco_zoo_models import split_model
    from redco_zoo_models.toy import chat_word_tokenizer, tiny_llama
    words = ["system", "user", "assistant", "error", *TAGS, *"0123456789", "+"]
    tokenizer = chat_word_tokenizer(words)
    tokenizer.add_tokens(TAGS)  # split out of "<result>7</result>" (their ids unchanged)
    model = tiny_llama(len(tokenizer))
    rows = [{"prompt": f"{a} + {b}", "answer": str(a + b)} for a, b in zip(range(8), [3, 1] * 4)]
    (prompts, rows), _ = prompt_examples(tokenizer, (rows, rows[:1]), "prompt", 16)
    deployer = Deployer(jax_seed=0, workdir=str(tmp_path), verbose=False)
    apply_fn, params = split_model(model)
    trainer = Trainer(deployer, collate_fn, apply_fn, loss_fn, params, optax.adam(learning_rate))
    grpo = MultiTurnGRPO(trainer, model, tokenizer, pred_fn, None, GRPOConfig(**config),
                         per_device_batch_size=4, make_env=make_env, max_turns=3)
    grpo.decide_layout(prompts, 0)
    return grpo, tokenizer, prompts, rows


def test_real_multi_turn_rollouts_call_the_tool_and_keep_their_ids(tmp_path):
    """8 prompts x 8 samples (temperature 2) of up to 3 turns in 16 tokens: some turns call the
    calculator; every environment span is exactly the tokenised ``<result>`` of Python's value of
    the call; the sampler's log-probabilities of the model's ids (their contexts holding the
    environment's ids) are the trainer's forward pass's. An environment's NaN reward is refused."""
    grpo, tokenizer, prompts, rows = calculator_grpo(tmp_path, Calculator, 1e-3, n_samples=8,
                                                     max_new_tokens=16, temperature=2.0)
    samples, metrics = grpo.rollout(prompts, rows, "prompt", 1)
    calls = 0
    for s in samples:
        ids, mask = s["tokens"].tolist(), s["completion_mask"]
        spans = np.split(np.arange(len(ids)), np.flatnonzero(np.diff(mask.astype(int))) + 1)
        for span in spans:
            if not mask[span[0]] and ids[span[0]] != 0:  # the environment's (not padding)
                said = tokenizer.decode(ids[:span[0]], skip_special_tokens=True)  # as stepped
                assert said.endswith("</calc>"), said
                call = said[said.rindex("<calc>") + len("<calc>"):-len("</calc>")]
                answer = tokenizer.encode(f"<result>{python_eval(call)}</result>",
                                          add_special_tokens=False)
                assert [ids[i] for i in span] == answer[:len(span)], (said, span)  # (a cut one)
                calls += 1
    assert calls >= 3, calls
    assert metrics["logprob_gap"] < 1e-4, metrics["logprob_gap"]

    class Broken(Calculator):
        def step(self, text):
            return None, float("nan"), True
    grpo.make_env = Broken
    with pytest.raises(UsageError, match=r"gave a reward nan in round 2's rollouts: give finite"):
        grpo.rollout(prompts, rows, "prompt", 2)


class RewardsCalls(Calculator):
    """The calculator, rewarding each call with 0.5 more, and 0.5 again where it evaluates."""

    def step(self, text):
        observation, reward, done = super().step(text)
        calls = observation is not None
        return observation, reward + 0.5 * calls + 0.5 * (calls and "error" not in observation), \
            done


def test_grpo_learns_to_call_the_tool(tmp_path):
    """Rewarded for calls (0.5) that the calculator evaluates (0.5 more), a tiny random model's
    rollouts earn ~0.06 an episode in GRPO's first 3 rounds and well over 1 by round 15 (seen:
    1.5-1.8; 1.98 by round 20)."""
    grpo, _, prompts, rows = calculator_grpo(tmp_path, RewardsCalls, 3e-3, n_samples=8,
                                             max_new_tokens=12)
    rewards = []
    for round_ in range(1, 16):
        samples, metrics = grpo.rollout(prompts, rows, "prompt", round_)
        grpo.trainer.train_scanned(samples, 4, range(round_ - 1, round_))
        rewards.append(metrics["reward"])
    assert np.mean(rewards[:3]) < 0.2 and np.mean(rewards[-3:]) > 1.0, rewards


def test_redco_zoo_run_grpo_with_the_calculator_environment(tmp_path, monkeypatch):
    """``redco zoo run grpo --environment calculator --max_turns 3``: two rounds of multi-turn
    rollouts and updates from a saved tiny model, their metrics logged, the model saved."""
    from redco_zoo_models.toy import CHAT_SPECIALS, chat_word_tokenizer, save_model_dir, tiny_llama
    words = ["system", "user", "assistant", "error", *TAGS, *"0123456789", "+"]
    tokenizer = chat_word_tokenizer(words)
    tokenizer.add_tokens(TAGS)
    save_model_dir(tiny_llama(len(CHAT_SPECIALS) + len(words)), tokenizer._tokenizer,
                   str(tmp_path / "tiny"))
    tokenizer.save_pretrained(tmp_path / "tiny")
    with open(tmp_path / "sums.jsonl", "w") as f:
        f.writelines(json.dumps({"prompt": f"{a} + {b}", "answer": str(a + b)}) + "\n"
                     for a in range(5) for b in range(4))
    monkeypatch.setenv("REDCO_DEBUG", "1")
    main(["zoo", "run", "grpo", "--model", str(tmp_path / "tiny"), "--train",
          str(tmp_path / "sums.jsonl"), "--workdir", str(tmp_path / "run"), "--environment",
          "calculator", "--max_turns", "3", "--n_rounds", "2", "--prompts_per_round", "4",
          "--n_samples", "8", "--per_device_batch_size", "4", "--max_new_tokens", "12",
          "--max_prompt_len", "16", "--temperature", "2.0"])
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    rounds = [r for r in rows if "rollout/reward" in r]
    assert len(rounds) == 2 and all(r["rollout/logprob_gap"] < 1e-4 for r in rounds), rounds
    assert sum("train/loss" in r for r in rows) == 2  # 32 samples in minibatches of 32
    assert (tmp_path / "run" / "model").is_dir()
    assert all(r["rollout/turns"] > 1 and r["rollout/environment_tokens"] > 0 for r in rounds)
