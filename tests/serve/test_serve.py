"""``redco serve`` as a user runs it: a real server process on 127.0.0.1 (the model split over 2
of 8 simulated devices), asked by the real ``openai`` client. Greedy answers are compared with
``generate`` run in this process on the same model directory, and with the story the model was
trained to tell."""
import os
import queue
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import openai
import optax
import pytest
from flax import nnx
from transformers import AutoTokenizer

from redco_zoo_models import split_model
from redco_zoo_models.generation import generate
from redco_zoo_models.hf import save_pretrained
from redco_zoo_models.runner import load_model
from redco_zoo_models.toy import save_tiny_chat_model

WORDS = "the cat sat on a mat and then it ran off system user assistant".split()
# What the served model is trained to tell, over and over. A word's successor depends on up to
# three words before it ("the" -> "cat" or "mat", "mat and" -> "then" or "the"), so answers
# need the attention over the cache; and none ends early.
STORY = "the cat sat on a mat and then it ran off the mat and".split()
MAX_LEN = 48
STARTUP_S = 300


class Server:
    def __init__(self, model_dir: str, *flags: str):
        env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "")
                                           + " --xla_force_host_platform_device_count=8")}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "redco.cli", "serve", "--model", model_dir, "--port", "0",
             "--max_seqs", "4", "--max_len", str(MAX_LEN), "--n_model_shards", "2", *flags],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.output, deadline = [], time.monotonic() + STARTUP_S
        while True:  # wait for the line that names the port (the socket is bound by then)
            line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            assert line is not None, "the server exited before serving:\n" + "".join(self.output)
            self.output.append(line)
            if "serving" in line:
                self.url = line.split(" on ")[1].strip()
                break
        self.client = openai.OpenAI(base_url=self.url, api_key="none", max_retries=0,
                                    timeout=120)

    def _read(self):
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def rest_of_output(self, timeout: float) -> str:
        lines, deadline = [], time.monotonic() + timeout
        while (line := self.lines.get(timeout=max(0.0, deadline - time.monotonic()))) is not None:
            lines.append(line)
        return "".join(lines)

    def close(self):
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=60)


def story_after(prompt: str, n_words: int) -> str:
    """The ``n_words`` words that follow ``prompt`` (a part of the story) in the story."""
    told = " ".join(STORY * (3 + n_words // len(STORY)))
    at = told.index(prompt, len(" ".join(STORY)))  # a place with the story before it
    return " ".join(told[at + len(prompt):].split()[:n_words])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny chat model trained (Adam, 40 full-batch steps) on the story at each of its
    offsets, in windows of ``MAX_LEN`` tokens."""
    path = save_tiny_chat_model(str(tmp_path_factory.mktemp("serve") / "tiny-chat"), WORDS)
    model, _ = load_model(path)
    told = AutoTokenizer.from_pretrained(path, local_files_only=True)(" ".join(STORY * 5))
    windows = np.array([told["input_ids"][i:i + MAX_LEN] for i in range(len(STORY))], np.int32)
    apply_fn, params = split_model(model)
    optimizer = optax.adam(1e-2)

    @jax.jit
    def step(params, state):
        grads = jax.grad(lambda p: optax.softmax_cross_entropy_with_integer_labels(
            apply_fn(p, windows[:, :-1]), windows[:, 1:]).mean())(params)
        updates, state = optimizer.update(grads, state)
        return optax.apply_updates(params, updates), state
    state = optimizer.init(params)
    for _ in range(40):
        params, state = step(params, state)
    nnx.update(model, params)
    save_pretrained(model, path)
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    """Prompts read 16 tokens a step, cached prefixes reused, on a paged cache of pages of 16
    tokens (what a plain server does, slots: test_serve_recurrent.py's), the layers scanned
    with the cache (``--scan_layers``): so the answers here, against the unrolled model's
    ``generate`` and transformers (lm-eval's hf backend), are the scanned paged pool's. The
    unrolled engine on pages, chunks and prefixes: test_engine_paged.py, test_engine.py."""
    server = Server(model_dir, "--prefill_chunk", "16", "--prefix_caching", "--page_size", "16",
                    "--scan_layers")
    started = "".join(server.output)
    assert "keys and values in 12 pages of 16 tokens" in started
    assert "the 2 layers stored stacked and run under a scan" in started, started
    yield server
    server.close()


@pytest.fixture(scope="module")
def reference(model_dir):
    """``generate``'s greedy text after token ids, cut at the EOS, as the server decodes it."""
    model, config = load_model(model_dir)
    params = nnx.state(model, nnx.Param)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)

    # jitted once: every prompt left-padded (masked) to WIDTH tokens, MOST_NEW tokens generated
    # and the first max_new kept (greedy: a longer run's first tokens are a shorter run's)
    run = jax.jit(lambda params, ids, mask: generate(model, params, ids, MOST_NEW,
                                                     prompt_mask=mask))

    def greedy(ids: list[int], max_new: int) -> tuple[str, str]:
        assert len(ids) <= WIDTH and max_new <= MOST_NEW, (len(ids), max_new)
        padded, mask = np.zeros((1, WIDTH), np.int32), np.zeros((1, WIDTH), bool)
        padded[0, WIDTH - len(ids):], mask[0, WIDTH - len(ids):] = ids, True
        tokens = [int(t) for t in run(params, padded, mask)[0, :max_new]]
        eos = tokenizer.eos_token_id
        reason = "stop" if eos in tokens else "length"
        return tokenizer.decode(tokens[:tokens.index(eos)] if eos in tokens else tokens,
                                skip_special_tokens=True), reason
    greedy.tokenizer = tokenizer
    return greedy


WIDTH, MOST_NEW = 28, 20  # the reference's one program: prompts up to 28 tokens, 20 new
PROMPTS = ["the cat sat on", "a mat and then it", "it ran off the mat and the cat sat"]


def test_models_health_and_tokenizer_endpoints_answer(server, reference):
    """/v1/models, /health, and vLLM's tokenizer endpoints (lm-eval's ``local-completions``
    tokenizes through them: test_lm_eval_scores_as_its_hf_backend_does) against the model's
    own tokenizer."""
    assert [m.id for m in server.client.models.list().data] == ["tiny-chat"]
    import httpx
    root, tokenizer = server.url.removesuffix("/v1"), reference.tokenizer
    health = httpx.get(root + "/health").json()
    assert health["status"] == "ok" and set(health["prefix_cache"]) == {
        "hits", "misses", "tokens_reused", "tokens_read"}
    info = httpx.get(root + "/tokenizer_info").json()
    assert (info["eos_token"], info["chat_template"]) == (tokenizer.eos_token,
                                                          tokenizer.chat_template)
    text = "the cat sat on a mat"
    ids = httpx.post(root + "/tokenize", json={"prompt": text}).json()["tokens"]
    assert ids == tokenizer(text)["input_ids"]
    assert httpx.post(root + "/detokenize", json={"tokens": ids}).json()["prompt"] == \
        tokenizer.decode(ids)
    refused = httpx.post(root + "/detokenize", json={"tokens": "the"})
    assert refused.status_code == 400 and "list of token ids" in refused.text


def test_a_prompt_sharing_a_cached_prefix_answers_as_generate(server, reference):
    """A 24-word prompt, then one sharing its first 20 words: the second copies a block of 16
    tokens from the first's row (a hit in /health) and answers as ``generate`` does."""
    import httpx
    health = lambda: httpx.get(server.url.removesuffix("/v1") + "/health").json()  # noqa: E731
    words = (STORY * 2)[:24]
    before = health()["prefix_cache"]
    for prompt in (" ".join(words), " ".join(words[:20] + ["the", "cat"])):
        expected, _ = reference(reference.tokenizer(prompt)["input_ids"], 12)
        answer = server.client.completions.create(model="tiny-chat", prompt=prompt,
                                                  max_tokens=12, temperature=0)
        assert answer.choices[0].text == expected
    after = health()["prefix_cache"]
    assert after["hits"] == before["hits"] + 1
    assert after["tokens_reused"] - before["tokens_reused"] == 16


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_completions_equal_generate(server, reference, stream):
    for prompt in PROMPTS:
        ids = reference.tokenizer(prompt)["input_ids"]
        expected, reason = reference(ids, 12)
        kwargs = dict(model="tiny-chat", prompt=prompt, max_tokens=12, temperature=0)
        if stream:
            chunks = list(server.client.completions.create(stream=True, **kwargs))
            text = "".join(c.choices[0].text for c in chunks)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
            assert finish == [reason] and len(chunks) > 2
        else:
            answer = server.client.completions.create(**kwargs)
            text = answer.choices[0].text
            assert answer.choices[0].finish_reason == reason
            assert answer.usage.prompt_tokens == len(ids)
        assert text == expected, prompt


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions_use_the_chat_template(server, reference, stream):
    messages = [{"role": "user", "content": "the cat sat on the mat"}]
    ids = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=True, return_dict=True)["input_ids"]
    expected, reason = reference(ids, 10)
    kwargs = dict(model="tiny-chat", messages=messages, max_tokens=10, temperature=0)
    if stream:
        chunks = list(server.client.chat.completions.create(stream=True, **kwargs))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert chunks[-1].choices[0].finish_reason == reason
    else:
        answer = server.client.chat.completions.create(**kwargs)
        text = answer.choices[0].message.content
        assert answer.choices[0].finish_reason == reason
    assert text == expected


def test_samples_stop_strings_and_logprobs(server, reference):
    answer = server.client.completions.create(model="tiny-chat", prompt="the cat", n=3,
                                              max_tokens=8, temperature=1.0, seed=7, logprobs=0)
    assert sorted(c.index for c in answer.choices) == [0, 1, 2]
    for choice in answer.choices:
        assert len(choice.logprobs.token_logprobs) >= 1
        assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    returned = sum(len(c.logprobs.token_logprobs) for c in answer.choices)
    assert answer.usage.completion_tokens == returned  # the tokens returned, not max_tokens
    again = server.client.completions.create(model="tiny-chat", prompt="the cat", n=3,
                                             max_tokens=8, temperature=1.0, seed=7, logprobs=0)
    assert [c.text for c in again.choices] == [c.text for c in answer.choices]  # seeded
    greedy = dict(model="tiny-chat", prompt=PROMPTS[2], max_tokens=20, temperature=0)
    full = server.client.completions.create(**greedy).choices[0].text
    assert full.split() == story_after(PROMPTS[2], 20).split()  # "on a mat and then it ran ..."
    answer = server.client.completions.create(stop=["xyz", "it"], logprobs=0, **greedy)
    cut = answer.choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[:full.index("it")]
    returned = len(cut.logprobs.token_logprobs)  # (up to the token that ends in the stop string)
    assert answer.usage.completion_tokens == returned < greedy["max_tokens"]
    streamed = "".join(c.choices[0].text for c in server.client.completions.create(
        stop=["xyz", "it"], stream=True, **greedy))
    assert streamed == cut.text


def test_echo_gives_the_prompts_log_probabilities_as_a_forward_pass_does(server, model_dir):
    """What lm-eval asks to score a multiple-choice answer: the prompt's tokens' log-probabilities
    (``echo``), each with its likeliest alternatives, against the model's own forward pass."""
    model, _ = load_model(model_dir)
    ids = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)(
        "the cat sat on a mat and it")["input_ids"]
    expected = np.asarray(jax.nn.log_softmax(model(jnp.asarray([ids]))[0].astype(jnp.float32)))
    answer = server.client.completions.create(model="tiny-chat", prompt=ids, echo=True,
                                              logprobs=2, max_tokens=1, temperature=0)
    got = answer.choices[0].logprobs
    assert len(got.tokens) == len(ids) + 1 and got.token_logprobs[0] is None
    mine = [expected[i, t] for i, t in enumerate(ids[1:])]
    np.testing.assert_allclose(got.token_logprobs[1:len(ids)], mine, atol=1e-4)
    for place, alternatives in enumerate(got.top_logprobs[1:], start=0):
        assert len(alternatives) == 2
        assert max(alternatives.values()) == pytest.approx(expected[place].max(), abs=1e-4)
    greedy = int(expected[-1].argmax())  # the completion: the greedy token, its own logprob
    assert got.token_logprobs[-1] == pytest.approx(expected[-1, greedy], abs=1e-4)
    assert answer.choices[0].text.startswith("the cat sat on a mat and it")
    chat = server.client.chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": "the cat"}], max_tokens=3,
        temperature=0, logprobs=True, top_logprobs=3).choices[0].logprobs.content
    assert len(chat) == 3 and all(len(c.top_logprobs) == 3 for c in chat)
    for c in chat:  # greedy: each token is its place's likeliest
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-4)


def test_top_k_1_and_a_vanishing_top_p_answer_greedily(server, reference):
    """After "the" the story goes on with "cat" or "mat": the same seeded request at T 1.5
    without a cut samples off ``generate``'s greedy text, with either cut it gives that text
    (the trained model is so sure elsewhere that T 1.5 alone gives greedy words)."""
    expected = reference(reference.tokenizer("the")["input_ids"], 8)[0]
    asked = dict(model="tiny-chat", prompt="the", max_tokens=8, temperature=1.5, seed=3)
    assert server.client.completions.create(**asked).choices[0].text != expected
    for cut in ({"top_p": 1e-9}, {"extra_body": {"top_k": 1}}):
        answer = server.client.completions.create(**asked, **cut)
        assert answer.choices[0].text == expected, cut


@pytest.mark.parametrize("kwargs, status, says", [
    (dict(prompt="the cat " * 40), 400, "--max_len"),
    (dict(prompt="the cat", max_tokens=1000), 400, "max_tokens=1000"),
    (dict(prompt="the cat", temperature=-1), 400, "temperature=-1"),
    (dict(prompt="the cat", n=9), 400, "n=9"),
    (dict(prompt="the cat", echo=True, stream=True), 400, "whole replies only"),
    (dict(prompt="the cat", logprobs=21), 400, "logprobs=21"),
    (dict(prompt="the cat", extra_body={"ignore_eos": "yes"}), 400, "ignore_eos"),
    (dict(prompt=""), 400, "prompt"),
    (dict(prompt="the cat", model="gpt-4"), 404, "'gpt-4' does not exist"),
])
def test_bad_requests_get_a_4xx_that_says_what_is_wrong(server, kwargs, status, says):
    kwargs = {"model": "tiny-chat", **kwargs}
    with pytest.raises(openai.APIStatusError) as refused:
        server.client.completions.create(**kwargs)
    assert refused.value.status_code == status
    assert says in refused.value.message
    assert server.client.completions.create(model="tiny-chat", prompt="the cat",
                                            max_tokens=2).choices  # still serving


def test_64_concurrent_clients_all_get_their_answers(server, reference):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(64)]
    expected = {p: reference(reference.tokenizer(p)["input_ids"], 6)[0] for p in PROMPTS}

    def ask(prompt):
        return server.client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=6,
                                                temperature=0).choices[0].text

    start = time.perf_counter()
    with ThreadPoolExecutor(64) as pool:
        answers = list(pool.map(ask, prompts))
    together = time.perf_counter() - start
    assert answers == [expected[p] for p in prompts]  # none lost, none mixed up
    start = time.perf_counter()
    for prompt in prompts[:8]:
        ask(prompt)
    one_at_a_time = (time.perf_counter() - start) * 8
    print(f"64 clients: {together:.2f} s together, ~{one_at_a_time:.2f} s one at a time")


def test_streamed_text_holds_back_what_may_become_a_stop_string(reference):
    """A stop string across two tokens ("t s" in "cat sat"): the "t" that may start it is not
    sent until the next token shows it does, so the streamed text is the whole text's."""
    from redco_serve.text import TextStream
    tokenizer = reference.tokenizer
    stream, sent = TextStream(tokenizer, ["t s"]), []
    for token in tokenizer("the cat sat on")["input_ids"]:
        sent.append(stream.push(token))
        if stream.stopped:
            break
    sent.append(stream.finish())
    assert stream.stopped and stream.text == "the ca"
    assert "".join(sent) == "the ca" and sent[1] == " ca"  # "t" held back after "cat"


def test_streamed_text_of_a_byte_level_bpe_equals_the_whole_decode():
    """Incremental decoding with a real byte-level BPE (trained here): characters of 2 to 4
    bytes split over tokens are held back until whole, and the pieces join to the whole text."""
    from redco_serve.text import TextStream
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast
    corpus = ["the cat sat on the mat", "naïve café, 日本語のテキスト", "emoji 🐈‍⬛ and ü"] * 5
    trained = ByteLevelBPETokenizer()
    trained.train_from_iterator(corpus, vocab_size=300, min_frequency=1, show_progress=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=trained._tokenizer)
    text = "the naïve cat 日本語 sat 🐈‍⬛ on the mat ü"
    ids = tokenizer(text)["input_ids"]
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)  # some tokens split a character
    stream = TextStream(tokenizer, [])
    pieces = [stream.push(t) for t in ids] + [stream.finish()]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


CHOICE_TASK = """task: story_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{answer}}}}"
doc_to_choice: "{{{{choices}}}}"
metric_list:
  - metric: acc
"""
CONTINUE_TASK = """task: story_continue
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["xyz"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
"""


def test_lm_eval_scores_as_its_hf_backend_does(server, model_dir, tmp_path):
    """``lm_eval --model local-completions`` against the server and lm-eval's own ``hf`` backend
    (transformers on PyTorch) on the same model directory, on tasks written here: the same
    log-likelihood for every choice (to 1e-3) and the same generations. No tokenizer is given
    to local-completions: it tokenizes through the server's /tokenize (found by
    /tokenizer_info), so a wrong or missing endpoint fails here."""
    import json

    import lm_eval
    from lm_eval.tasks import TaskManager
    docs = {"choice": [{"context": c, "choices": [story_after(c, 2), "the ran"], "answer": 0}
                       for c in PROMPTS],
            "continue": [{"context": c, "answer": story_after(c, 6)} for c in PROMPTS]}
    for name, task in (("choice", CHOICE_TASK), ("continue", CONTINUE_TASK)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(d) + "\n" for d in docs[name]))
        (tmp_path / f"{name}.yaml").write_text(task.format(path=path))

    # only the tasks written here: indexing lm-eval's thousands of own tasks costs ~9 s a time
    tasks = TaskManager(include_path=str(tmp_path), include_defaults=False)

    def evaluate(model: str, model_args: dict) -> dict:
        return lm_eval.simple_evaluate(
            model=model, model_args=model_args, tasks=["story_choice", "story_continue"],
            task_manager=tasks, log_samples=True)["samples"]
    served = evaluate("local-completions", {  # (no tokenizer given: lm-eval finds the
        "model": "tiny-chat", "base_url": server.url + "/completions",  # server's endpoints
        "max_retries": 1})                                               # and tokenizes there)
    hf = evaluate("hf", {"pretrained": model_dir, "dtype": "float32", "device": "cpu"})
    scored = [(s["filtered_resps"], h["filtered_resps"]) for s, h in
              zip(served["story_choice"], hf["story_choice"])]
    assert len(scored) == len(PROMPTS) and all(len(s) == 2 for s, _ in scored)
    for mine, theirs in scored:
        for (loglikelihood, greedy), (expected, expected_greedy) in zip(mine, theirs):
            assert loglikelihood == pytest.approx(expected, abs=1e-3)
            assert greedy == expected_greedy
    assert all(m[0][0] > m[1][0] for m, _ in scored)  # the story's words are likelier
    generations = [(s["filtered_resps"][0], h["filtered_resps"][0])
                   for s, h in zip(served["story_continue"], hf["story_continue"])]
    assert all(mine == theirs and mine.split() for mine, theirs in generations), generations
