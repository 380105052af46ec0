"""Supervised fine-tuning on chats: the assistant's tokens found through a real chat template
(ChatML, rendered by transformers), the loss provably blind to the rest, chats packed, bad chats
refused, and a tiny LLaMA that learns a chat task through `redco zoo run sft`."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from post_training_task import WORDS

from redco.cli import main
from redco.protocols import UsageError
from redco_zoo_models.toy import (
    CHAT_SPECIALS,
    CHATML,
    chat_word_tokenizer,
    save_model_dir,
    tiny_llama,
)
from redco_zoo_sft import collate_fn, loss_fn, pack_chats, render_chat
from redco_zoo_sft.pipeline import load_chat_tokenizer

SPECIALS = list(CHAT_SPECIALS)

def chat_tokenizer(template=CHATML):
    """A word-level tokenizer of ``WORDS`` with the ChatML template, as transformers loads one."""
    return chat_word_tokenizer(WORDS, template)


def chat(pairs, system="map it"):
    """A chat: the system message, then per pair the user's word and the assistant's answer."""
    messages = [{"role": "system", "content": system}]
    for x, y in pairs:
        messages += [{"role": "user", "content": x}, {"role": "assistant", "content": y}]
    return messages


def test_the_assistants_tokens_are_found_through_the_template():
    tokenizer = chat_tokenizer()
    rendered = render_chat(tokenizer, chat([("x1", "y2"), ("x3", "y4")]), 64)
    words = tokenizer.convert_ids_to_tokens(rendered["token_ids"].tolist())
    assert words == ["<|im_start|>", "system", "map", "it", "<|im_end|>",
                     "<|im_start|>", "user", "x1", "<|im_end|>", "<|im_start|>", "assistant", "y2",
                     "<|im_end|>", "<|im_start|>", "user", "x3", "<|im_end|>", "<|im_start|>",
                     "assistant", "y4", "<|im_end|>"]
    marked = [w for w, m in zip(words, rendered["loss_mask"]) if m]
    assert marked == ["y2", "<|im_end|>", "y4", "<|im_end|>"]  # answers and their end of turn


def test_the_loss_is_blind_to_every_token_but_the_assistants():
    """With logits that are parameters themselves, the loss's gradient is zero at every position
    whose next token is not the assistant's, and changing the system's and user's tokens changes
    nothing."""
    tokenizer = chat_tokenizer()
    rows = pack_chats([render_chat(tokenizer, chat([("x1", "y2")]), 32),
                       render_chat(tokenizer, chat([("x5", "y6"), ("x7", "y8")]), 32)], 32)
    batch = collate_fn(rows)
    logits = jax.random.normal(jax.random.PRNGKey(0), (*batch["input_ids"][:, :-1].shape,
                                                       len(SPECIALS) + len(WORDS)))

    class State:
        apply_fn = staticmethod(lambda params, ids, segment_ids: params)

    def grad(batch):
        return jax.grad(lambda p: loss_fn(None, State, p, batch, True))(logits)
    g = grad(batch)
    predicts_assistant = batch["loss_mask"][:, 1:]
    assert (jnp.abs(g).sum(-1) > 0).tolist() == predicts_assistant.tolist()
    changed = dict(batch, input_ids=np.where(batch["loss_mask"], batch["input_ids"],
                                             np.random.default_rng(0).integers(
                                                 5, 40, batch["input_ids"].shape)))
    np.testing.assert_array_equal(grad(changed), g)


def test_packed_chats_keep_their_tokens_and_masks():
    tokenizer = chat_tokenizer()
    chats = [render_chat(tokenizer, chat([(f"x{i}", f"y{i}")] * (1 + i % 3)), 64)
             for i in range(10)]
    rows = pack_chats(chats, 40)
    assert len(rows) < len(chats)  # several to a row
    found = sorted((tuple(r["token_ids"][r["segment_ids"] == s]),
                    tuple(r["loss_mask"][r["segment_ids"] == s]))
                   for r in rows for s in range(1, r["segment_ids"].max() + 1))
    assert found == sorted((tuple(c["token_ids"]), tuple(c["loss_mask"])) for c in chats)


@pytest.mark.parametrize("tokenizer, messages, message", [
    (chat_tokenizer(), [{"role": "user", "content": "x1"}], r"a chat has no assistant message"),
    (chat_tokenizer(template=None), chat([("x1", "y1")]), r"The tokenizer has no chat template"),
    (chat_tokenizer(template="{{ messages | length }}" + CHATML), chat([("x1", "y1")]),
     r"renders the chat up to message 2 as other than a prefix"),
    (chat_tokenizer(), chat([("x1", "y1")] * 9),
     r"a chat is 77 tokens once rendered, longer than --max_len 32"),
])
def test_a_chat_that_cannot_be_learned_from_is_refused(tokenizer, messages, message):
    with pytest.raises(UsageError, match=message):
        render_chat(tokenizer, messages, 32)


def write_chats(path, n, seed):
    """Chats of 1-3 turns: the user says x_i, the assistant answers y_(3i mod 20)."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(n):
            keys = rng.integers(0, 20, rng.integers(1, 4))
            f.write(json.dumps({"messages": chat([(f"x{k}", f"y{3 * k % 20}") for k in keys])})
                    + "\n")


def test_redco_zoo_run_sft_learns_a_chat_task(tmp_path):
    tokenizer = chat_tokenizer()
    model_dir = str(tmp_path / "model")
    save_model_dir(tiny_llama(len(SPECIALS) + len(WORDS)), tokenizer._tokenizer, model_dir)
    tokenizer.save_pretrained(model_dir)  # tokenizer_config.json, with the chat template
    write_chats(tmp_path / "train.jsonl", 400, seed=0)
    write_chats(tmp_path / "eval.jsonl", 40, seed=1)
    workdir = tmp_path / "run"
    main(["zoo", "run", "sft", "--model", model_dir, "--train", str(tmp_path / "train.jsonl"),
          "--eval", str(tmp_path / "eval.jsonl"), "--workdir", str(workdir), "--max_len", "64",
          "--per_device_batch_size", "2", "--n_epochs", "6", "--learning_rate", "3e-3"])
    with open(workdir / "metrics.jsonl") as f:
        rows = list(map(json.loads, f))
    first = next(row["train/loss"] for row in rows if "train/loss" in row)
    evals = [row["eval/loss"] for row in rows if "eval/loss" in row]
    assert first > 3.0, first  # untrained: near ln(49), the vocabulary
    assert evals[-1] < 0.3, evals  # held-out answers and ends of turn (measured 0.003-0.053)
    saved = load_chat_tokenizer(str(workdir / "model"))  # a model a next stage can take up
    assert saved.chat_template == tokenizer.chat_template
