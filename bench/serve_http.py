"""``redco serve`` through HTTP, as a user meets it: a server process on a tiny chat model, asked
by the real ``openai`` client, warm (a burst at every concurrency runs first, so nothing
compiles while timed). The client (``--client``): ``async`` (the default) is
``openai.AsyncOpenAI`` over the SDK's aiohttp transport (``DefaultAioHttpClient``; aiohttp
comes with ``openai[aiohttp]``, here with ``lm-eval[api]``), a burst's requests in one event
loop, as vLLM's serving benchmark drives a server (asyncio): about 0.9 ms of CPU a request on
the 2-core box, against 1.3 for ``threads`` (the sync ``openai.OpenAI`` from a pool of
threads, this bench's client before) and 1.8 for ``AsyncOpenAI`` over its default httpx.
Output tokens/s at 1, 8, 32 and 64 requests at once against the
same requests one at a time, and, beside each, the engine stepping alone (in this process, no
HTTP) over the same number of requests: the server's share of the engine's rate. The client and
the server share this machine's cores, so the CPU each spends a request is printed too.

Each request asks greedily for ``--new`` tokens after a short prompt, past the end token
(``ignore_eos``, as vLLM's serving benchmark asks); tokens are counted from
``usage.completion_tokens`` (the engine's from its samples), not assumed.

    python bench/serve_http.py [--new 32 --max_seqs 64 --max_len 256 --rounds 3 --client async]
"""
from __future__ import annotations

import argparse
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from provenance import print_provenance  # noqa: E402

WORDS = "the cat sat on a mat and then it ran off".split()
CONCURRENCY = (1, 8, 32, 64)


def start_server(model_dir: str, args) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "redco.cli", "serve", "--model", model_dir, "--port", "0",
         "--max_seqs", str(args.max_seqs), "--max_len", str(args.max_len)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in process.stdout] + [lines.put(None)],
                     daemon=True).start()
    deadline = time.monotonic() + 600
    start = time.monotonic()
    while (line := lines.get(timeout=max(0.0, deadline - time.monotonic()))) is not None:
        print(f"  [server, {time.monotonic() - start:6.1f} s] {line.rstrip()}", flush=True)
        if " on http" in line:  # (its start-up echoed: a slow start shows where it waits)
            return process, line.split(" on ")[1].strip()
    raise RuntimeError("the server exited before serving")


def save_chat_model(path: str, preset: str | None, shape: dict[str, int]) -> str:
    """A chat model directory of the word tokenizer: the tiny LLaMA, ``preset``'s shape, or
    the tiny LLaMA with ``shape``'s config entries (e.g. ``hidden_size``) replaced."""
    from redco_zoo_models import LLAMA_PRESETS
    from redco_zoo_models.toy import save_tiny_chat_model
    if preset is None and not shape:
        return save_tiny_chat_model(path, WORDS)
    if preset is not None:
        shape = {k: v for k, v in LLAMA_PRESETS[preset].items() if k != "vocab_size"}
    return save_tiny_chat_model(path, WORDS, family="llama-3.1", max_position_embeddings=4096,
                                **shape)


def model_name(args) -> str:
    """The served model as the table's title names it."""
    if args.preset:
        return args.preset
    if args.shape:
        return f"llama ({', '.join(f'{k} {v}' for k, v in args.shape.items())})"
    return "tiny_llama (width 64, 2 layers)"


def config_entries(text: str) -> dict[str, int]:
    """``--shape``'s ``key=value,...`` as config.json entries."""
    try:
        return {k: int(v) for k, v in (item.split("=") for item in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--shape {text!r}: write config entries as key=integer pairs joined by commas, "
            "e.g. hidden_size=512,num_hidden_layers=8") from None


CLIENTS = ThreadPoolExecutor(max(CONCURRENCY))  # the load generator's threads, made once


def request(i: int, new: int) -> dict:
    """Request ``i``'s completion arguments: greedy, ``new`` tokens past the end token."""
    return dict(model="tiny", prompt=" ".join(WORDS[i % 5:][:4]), max_tokens=new,
                temperature=0.0, extra_body={"ignore_eos": True})


def burst(client, n: int, new: int) -> tuple[float, int]:
    """``n`` completions at once from ``n`` client threads: (seconds, completion tokens)."""
    def one(i: int) -> int:
        return client.completions.create(**request(i, new)).usage.completion_tokens
    start = time.perf_counter()
    tokens = sum(CLIENTS.map(one, range(n)))
    return time.perf_counter() - start, tokens


class AsyncClient:
    """``openai.AsyncOpenAI`` over aiohttp in one event loop of this thread: ``burst`` as the
    threads' ``burst``, each request a coroutine."""

    def __init__(self, url: str):
        import asyncio

        import openai
        self.loop = asyncio.new_event_loop()
        self.client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0,
                                         timeout=600,
                                         http_client=openai.DefaultAioHttpClient(timeout=600))

    async def _one(self, i: int, new: int) -> int:
        reply = await self.client.completions.create(**request(i, new))
        return reply.usage.completion_tokens

    async def _all(self, n: int, new: int) -> int:
        import asyncio
        return sum(await asyncio.gather(*(self._one(i, new) for i in range(n))))

    def burst(self, n: int, new: int) -> tuple[float, int]:
        """``n`` completions at once: (seconds, completion tokens)."""
        start = time.perf_counter()
        tokens = self.loop.run_until_complete(self._all(n, new))
        return time.perf_counter() - start, tokens

    def close(self) -> None:
        self.loop.run_until_complete(self.client.close())
        self.loop.close()


def make_burst(kind: str, url: str):
    """``burst(n, new)`` of ``--client kind`` and what closes it."""
    import openai
    if kind == "async":
        client = AsyncClient(url)
        return client.burst, client.close
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
    return (lambda n, new: burst(client, n, new)), client.close


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used (all its threads)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def engine_alone(model_dir: str, n: int, new: int, args) -> float:
    """Output tok/s of the engine stepping in this process over ``n`` requests at once: the
    median of ``args.rounds`` runs (one run of a few ms swings with whatever else runs)."""
    from flax import nnx
    from transformers import AutoTokenizer

    from redco_zoo_models.engine import Engine
    from redco_zoo_models.requests import Sampling
    from redco_zoo_models.runner import load_model
    if model_dir not in ENGINES:
        model, _ = load_model(model_dir)
        ENGINES[model_dir] = Engine(model, nnx.state(model, nnx.Param), max_seqs=args.max_seqs,
                                    max_len=args.max_len)
    engine = ENGINES[model_dir]
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    prompts = [tokenizer(" ".join(WORDS[i % 5:][:4]))["input_ids"] for i in range(n)]
    sampling = Sampling(max_tokens=new, ignore_eos=True)
    engine.generate(prompts, sampling)  # compile this shape
    rates = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        requests = engine.generate(prompts, sampling)
        tokens = sum(len(s.tokens) for r in requests for s in r.samples)
        rates.append(tokens / (time.perf_counter() - start))
    return statistics.median(rates)


ENGINES: dict = {}
CLIENT_NAMES = {"async": "openai.AsyncOpenAI (aiohttp), one event loop",
                "threads": "openai.OpenAI from 64 threads"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--max_seqs", type=int, default=64)
    parser.add_argument("--max_len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--preset", help="a LLAMA_PRESETS shape (e.g. llama-1b, random weights, "
                        "the word tokenizer's vocabulary) instead of the tiny model")
    parser.add_argument("--shape", type=config_entries, default={},
                        help="the tiny model's config entries to replace, key=value,... (e.g. "
                        "hidden_size=512,intermediate_size=1024,num_hidden_layers=8)")
    parser.add_argument("--client", choices=["async", "threads"], default="async",
                        help="async: openai.AsyncOpenAI (aiohttp) in one event loop; threads: "
                        "the sync openai.OpenAI from a pool of threads")
    args = parser.parse_args()
    print_provenance()

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        model_dir = save_chat_model(os.path.join(tmp, "tiny"), args.preset, args.shape)

        def stage(what: str) -> None:
            print(f"[{time.perf_counter() - start:6.1f} s] {what}", flush=True)
        stage("model saved")
        process, url = start_server(model_dir, args)
        stage(f"serving on {url}")
        try:
            ask, close = make_burst(args.client, url)
            for n in CONCURRENCY:  # warm: every batch shape compiles here
                ask(n, args.new)
                stage(f"warm at {n} at once")
            rates = {n: [] for n in CONCURRENCY}
            cpu = {n: [0.0, 0.0, 0] for n in CONCURRENCY}  # client s, server s, requests
            serial = []
            for _ in range(args.rounds):
                seconds, tokens = 0.0, 0
                for _ in range(32):
                    s, t = ask(1, args.new)
                    seconds, tokens = seconds + s, tokens + t
                serial.append(tokens / seconds)
                for n in CONCURRENCY:
                    mine, theirs = time.process_time(), cpu_seconds(process.pid)
                    s, t = ask(n, args.new)
                    rates[n].append(t / s)
                    cpu[n][0] += time.process_time() - mine
                    cpu[n][1] += cpu_seconds(process.pid) - theirs
                    cpu[n][2] += n
            close()
        finally:
            process.terminate()
            process.wait(timeout=120)
        one = statistics.median(serial)
        print(f"{model_name(args)}, {args.new} new tokens a "
              f"request, --max_seqs {args.max_seqs} --max_len {args.max_len}; medians of "
              f"{args.rounds} rounds; client: {CLIENT_NAMES[args.client]}")
        print(f"{'at once':>8} {'HTTP tok/s':>11} {'vs 1 at a time':>15} {'engine alone tok/s':>19}"
              f" {'HTTP / engine':>14} {'CPU ms a request: client':>25} {'server':>7}")
        print(f"{'serial':>8} {one:>11.0f} {1.0:>14.2f}x")
        for n in CONCURRENCY:
            http = statistics.median(rates[n])
            alone = engine_alone(model_dir, n, args.new, args)
            client_ms, server_ms = (1000 * x / cpu[n][2] for x in cpu[n][:2])
            print(f"{n:>8} {http:>11.0f} {http / one:>14.2f}x {alone:>19.0f} {http / alone:>13.2f}x"
                  f" {client_ms:>25.2f} {server_ms:>7.2f}")


if __name__ == "__main__":
    main()
