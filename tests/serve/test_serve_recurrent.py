"""``redco serve`` on a recurrent family (Qwen3.5: Gated DeltaNet layers around an attention
one), split over 2 of 8 simulated devices (its fixed-size states' rows over the replicas),
asked by the real ``openai`` client: a greedy completion's text and log-probs are transformers'
(CPU torch) for the same model directory. The same process then proves SIGTERM's drain: a
streamed request in flight when the signal comes is finished (transformers' text again) and the
server exits 0."""
import signal

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


def transformers_greedy(model_dir):
    """transformers' greedy tokens after ``PROMPT`` (cut at the EOS), their log-probs, why the
    generation ended, and the tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    theirs = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        out = theirs.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False,
                              eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id)[0, len(ids):].tolist()
        ended = tokenizer.eos_token_id in out
        tokens = out[:out.index(tokenizer.eos_token_id)] if ended else out
        logits = theirs(torch.tensor([ids + tokens])).logits[0].double()
    places = np.arange(len(tokens)) + len(ids) - 1
    logprobs = torch.log_softmax(logits, -1).numpy()[places, tokens]
    return tokens, logprobs, "stop" if ended else "length", tokenizer


def test_a_greedy_completion_equals_transformers_and_sigterm_finishes_it(model_dir):
    """A whole completion gives transformers' text and log-probs. Then a 48-token completion
    (past the end token), streamed and SIGTERMed after its first chunk, still running: the
    stream ends with the whole text the same request gave unstreamed, and the server exits 0
    saying it finished the requests in flight (the only CI test of the drain: a server that
    dropped the stream, or died by the signal, fails)."""
    tokens, logprobs, reason, tokenizer = transformers_greedy(model_dir)
    expected = tokenizer.decode(tokens, skip_special_tokens=True)
    server = Server(model_dir, "--max_seqs", "2", "--max_len", "64")
    try:
        ask = dict(model="tiny-qwen", prompt=PROMPT, max_tokens=NEW, temperature=0)
        answer = server.client.completions.create(logprobs=0, **ask)
        long = dict(ask, max_tokens=48, extra_body={"ignore_eos": True})
        whole = server.client.completions.create(**long)
        chunks = iter(server.client.completions.create(stream=True, **long))
        first = next(chunks)  # the request is running
        server.process.send_signal(signal.SIGTERM)
        rest = list(chunks)
        assert server.process.wait(timeout=120) == 0
        assert "finishing the requests in flight" in server.rest_of_output(30)
    finally:
        server.close()
    assert answer.choices[0].text == expected and answer.choices[0].finish_reason == reason
    np.testing.assert_allclose(answer.choices[0].logprobs.token_logprobs[:len(tokens)],
                               logprobs, atol=1e-5)
    assert whole.usage.completion_tokens == 48
    assert "".join(c.choices[0].text for c in [first, *rest]) == whole.choices[0].text
    assert rest and rest[-1].choices[0].finish_reason == "length"
