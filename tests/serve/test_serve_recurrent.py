"""``redco serve`` on a recurrent family (Qwen3.5: Gated DeltaNet layers around an attention
one), split over 2 of 8 simulated devices (its fixed-size states' rows over the replicas),
asked by the real ``openai`` client: a greedy completion's text and log-probs are transformers'
(CPU torch) for the same model directory."""
import numpy as np
import pytest
import torch
from test_serve import WORDS, Server
from transformers import AutoModelForCausalLM, AutoTokenizer

from redco_zoo_models.toy import save_tiny_chat_model

PROMPT, NEW = "the cat sat on a mat and then", 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen3.5 and its word tokenizer, weights perturbed by 0.1 in transformers (so that
    a state off by a padded token shows in the log-probs) and saved back."""
    path = save_tiny_chat_model(str(tmp_path_factory.mktemp("serve") / "tiny-qwen"), WORDS,
                                family="qwen3.5")
    model = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


def test_a_greedy_completion_equals_transformers(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    theirs = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        out = theirs.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False,
                              eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id)[0, len(ids):].tolist()
        tokens = out[:out.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in out \
            else out
        logits = theirs(torch.tensor([ids + tokens])).logits[0].double()
    places = np.arange(len(tokens)) + len(ids) - 1
    logprobs = torch.log_softmax(logits, -1).numpy()[places, tokens]
    server = Server(model_dir, "--max_seqs", "2", "--max_len", "16")
    try:
        answer = server.client.completions.create(
            model="tiny-qwen", prompt=PROMPT, max_tokens=NEW, temperature=0, logprobs=0)
    finally:
        server.close()
    assert answer.choices[0].text == tokenizer.decode(tokens, skip_special_tokens=True)
    np.testing.assert_allclose(answer.choices[0].logprobs.token_logprobs[:len(tokens)],
                               logprobs, atol=1e-5)
