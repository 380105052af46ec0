"""DPO on chats: only the replies' tokens counted, the LoRA reference is the base with its
adapters zeroed (the loss starts at ln 2), identical pairs refused, and a tiny LLaMA's held-out
preference accuracy rises from about 0.5 to 0.9 or more, through LoRA and through full
fine-tuning with reference log-probabilities computed once before training."""
import json
import math
from functools import partial

import jax
import numpy as np
import pytest
from test_sft import SPECIALS, WORDS, chat_tokenizer

from redco.cli import main
from redco.lora import trainable_mask
from redco.protocols import UsageError
from redco_zoo_dpo import collate_fn, loss_fn
from redco_zoo_dpo.pipeline import render_pair, reply_logps
from redco_zoo_models import split_model
from redco_zoo_models.lora import add_lora
from redco_zoo_models.toy import save_model_dir, tiny_llama

VOCAB = len(SPECIALS) + len(WORDS)


def pair(k, wrong, prompt_turns=()):
    """The user says x_k; chosen: y_(3k mod 20), rejected: y_wrong."""
    prompt = [m for x, y in prompt_turns for m in ({"role": "user", "content": x},
                                                   {"role": "assistant", "content": y})]
    return {"prompt": prompt + [{"role": "user", "content": f"x{k}"}],
            "chosen": f"y{3 * k % 20}", "rejected": f"y{wrong}"}


def test_only_the_replies_tokens_count_and_identical_pairs_are_refused():
    tokenizer = chat_tokenizer()
    rendered = render_pair(tokenizer, pair(2, 5, prompt_turns=[("x1", "y3")]), 64, "row 0")
    for name, reply in (("chosen", "y6"), ("rejected", "y5")):
        r = rendered[name]
        words = tokenizer.convert_ids_to_tokens(r["token_ids"][r["loss_mask"]].tolist())
        assert words == [reply, "<|im_end|>"]  # the prompt's own assistant turn is not counted
    with pytest.raises(UsageError, match=r"row 3: chosen and rejected are the same reply"):
        render_pair(tokenizer, pair(2, 6), 64, "row 3")


def test_the_lora_reference_is_the_base_so_the_loss_starts_at_ln_2():
    tokenizer = chat_tokenizer()
    model = tiny_llama(VOCAB)
    add_lora(model, rank=4, alpha=8.0, seed=0)
    apply_fn, params = split_model(model)
    batch = collate_fn([render_pair(tokenizer, pair(k, (k + 1) % 20), 32, "row")
                        for k in range(4)], 32)

    class State:
        pass
    State.apply_fn = staticmethod(apply_fn)
    loss_and_grads = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(None, State, p, b, True)))
    loss, grads = loss_and_grads(params, batch)
    assert abs(float(loss) - math.log(2)) < 1e-6  # lora_b starts at zero: policy == reference
    # the reference is a constant: the same gradients as with the base's log-probabilities given
    reference = jax.jit(partial(reply_logps, apply_fn))(params, batch)
    given = dict(batch, ref_logps=np.asarray(reference))
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(loss_and_grads(params, given)[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    assert any(np.any(np.asarray(g)) for g, m in zip(jax.tree.leaves(grads),
                                                     jax.tree.leaves(trainable_mask(params))) if m)


def write_pairs(path, n, seed):
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for k in rng.integers(0, 20, n):
            wrong = (3 * k + rng.integers(1, 20)) % 20
            f.write(json.dumps(pair(int(k), int(wrong))) + "\n")


def preference_accuracy(model_dir, tokenizer, path) -> float:
    """How often the model in ``model_dir`` gives the chosen reply the higher log-probability."""
    from redco_zoo_models import LlamaForCausalLM, from_pretrained
    apply_fn, params = split_model(from_pretrained(LlamaForCausalLM, model_dir))
    with open(path) as f:
        pairs = [render_pair(tokenizer, json.loads(line), 16, "row") for line in f]
    logps = np.asarray(jax.jit(partial(reply_logps, apply_fn))(params, collate_fn(pairs, 16)))
    return float(np.mean(logps[:, 0] > logps[:, 1]))


@pytest.mark.parametrize("lora", [True, False])
def test_redco_zoo_run_dpo_learns_the_preferences(tmp_path, lora):
    tokenizer = chat_tokenizer()
    model_dir = str(tmp_path / "model")
    save_model_dir(tiny_llama(VOCAB), tokenizer._tokenizer, model_dir)
    tokenizer.save_pretrained(model_dir)
    write_pairs(tmp_path / "train.jsonl", 400, seed=0)
    write_pairs(tmp_path / "eval.jsonl", 100, seed=1)
    untrained = preference_accuracy(model_dir, tokenizer, tmp_path / "eval.jsonl")
    assert 0.3 < untrained < 0.7, untrained  # the untrained model prefers either about as often
    workdir = tmp_path / "run"
    main(["zoo", "run", "dpo", "--model", model_dir, "--train", str(tmp_path / "train.jsonl"),
          "--eval", str(tmp_path / "eval.jsonl"), "--workdir", str(workdir), "--max_len", "16",
          "--per_device_batch_size", "2", "--n_epochs", "2", "--learning_rate", "3e-3",
          "--beta", "0.5", *(["--lora_rank", "8"] if lora else [])])
    with open(workdir / "metrics.jsonl") as f:
        accuracy = [row["eval/accuracy"] for row in map(json.loads, f) if "eval/accuracy" in row]
    assert accuracy[-1] >= 0.9, accuracy
    print(f"held-out preference accuracy by epoch: {accuracy}; untrained: {untrained}")
