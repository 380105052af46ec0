"""The zoo's pipelines end to end on the recurrent families: Qwen3.5 (Gated DeltaNet beside gated
attention) and Granite 4 hybrid (Mamba2 beside attention, MoE with a shared MLP), each at dp 4 x
mp 2. ``redco zoo run sft`` packs chats into rows (each document's recurrent state starts from
zero at its boundary) and learns the README's task; its export is read by transformers'
PyTorch model with our logits; ``redco zoo run grpo`` samples on the engine (a fixed-size
recurrent state a row) with the log-probabilities its trainer recomputes, and exports what
transformers loads.

Granite 4 hybrid's runs are slow-tier repeats of the same pipelines on Mamba2: in CI its packed
rows are guarded by tests/zoo/test_hybrid.py::test_packed_documents_see_only_themselves, its
engine decoding against transformers by
test_parity_recurrent_engine.py::test_greedy_tokens_and_logprobs_equal_transformers_as_rows_are_reused
and its export by test_parity_families.py's
test_export_loads_in_transformers_with_the_same_logits_and_token_ids."""
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from parity import load_hf, transformers

from redco.cli import main
from redco_zoo_models import from_pretrained
from redco_zoo_models.hf import auto_class
from redco_zoo_models.toy import save_tiny_chat_model

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from post_training_task import WORDS, write_task  # noqa: E402

UNTRAINED = np.log(4 + len(WORDS))  # an untrained model's loss: ln of the vocabulary


def metrics(path) -> list[dict]:
    with open(path) as f:
        return list(map(json.loads, f))


@pytest.fixture(scope="module", params=["qwen3.5", pytest.param("granite-4-h",
                                                                 marks=pytest.mark.slow)])
def sft_run(request, tmp_path_factory):
    """The README's task and a tiny ``family`` model SFT-trained on it: the run's root."""
    root = tmp_path_factory.mktemp(request.param)
    write_task(root, seed=0)
    save_tiny_chat_model(str(root / "tiny-chat"), WORDS, 0, family=request.param)
    main(["zoo", "run", "sft", "--model", str(root / "tiny-chat"), "--train",
          str(root / "chats.jsonl"), "--workdir", str(root / "sft"), "--max_len", "16",
          "--per_device_batch_size", "2", "--n_epochs", "3", "--learning_rate", "3e-3",
          "--n_model_shards", "2"])
    return root


def test_sft_learns_on_packed_chats_and_exports_what_transformers_computes(sft_run):
    rows = metrics(sft_run / "sft" / "metrics.jsonl")
    first = next(r["train/loss"] for r in rows if "train/loss" in r)
    last_eval = [r["eval/loss"] for r in rows if "eval/loss" in r][-1]
    # Half the answers are learnable, half drawn from 20 words: the best loss is ~0.75 x ln 20
    # / 2 a token of the answer + end of turn (measured 1.40 on Qwen3.5).
    assert first > 0.8 * UNTRAINED and last_eval < 0.6 * UNTRAINED, (first, last_eval)
    path = str(sft_run / "sft" / "model")
    theirs = load_hf(transformers.AutoModelForCausalLM, path)
    ours = from_pretrained(auto_class(path), path)
    ids = np.random.RandomState(0).randint(4, 4 + len(WORDS), (2, 21))  # past conv and chunk
    with torch.no_grad():
        want = theirs(torch.tensor(ids), use_cache=False).logits.numpy()
    graphdef, state = nnx.split(ours)  # compiled: eagerly each op of the delta rule compiles
    got = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids))(state, jnp.asarray(ids))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-4)


def test_grpo_samples_on_the_engine_with_the_trainers_log_probabilities(sft_run):
    workdir = sft_run / "grpo"
    main(["zoo", "run", "grpo", "--model", str(sft_run / "sft" / "model"), "--train",
          str(sft_run / "prompts.jsonl"), "--workdir", str(workdir), "--n_rounds", "1",
          "--n_model_shards", "2", "--per_device_batch_size", "2", "--max_new_tokens", "4",
          "--max_prompt_len", "16", "--prompts_per_round", "8", "--n_samples", "8",
          "--engine_rows", "8", "--learning_rate", "5e-4"])
    rollout = next(r for r in metrics(workdir / "metrics.jsonl") if "rollout/logprob_gap" in r)
    # the engine's recurrent decoding against the trainer's chunked forward, sampled tokens
    assert rollout["rollout/logprob_gap"] < 1e-4, rollout
    assert rollout["rollout/completion_tokens"] >= 1, rollout
    losses = [r["train/loss"] for r in metrics(workdir / "metrics.jsonl") if "train/loss" in r]
    assert losses and np.isfinite(losses).all(), losses
    load_hf(transformers.AutoModelForCausalLM, str(workdir / "model"))
