"""The continuous-batching engine against ``generate``, in one process on this machine's CPU (or
its accelerator), compile times left out (each configuration runs once before it is timed).

1. **Serving**: ``--requests`` prompts of 8 to 48 tokens (random), ``--new`` tokens each, no
   EOS: output tokens/s of the engine (``--rows`` sequences at once) with 1, 8 and 64 requests
   arriving together, against ``generate`` run one request at a time (prompts left-padded to
   one width, so it compiles once).
2. **GRPO rollouts**: ``--prompts`` prompts x G=8 samples at temperature 1 of a model whose EOS
   is one of its 64 tokens (completions end at varied lengths, as real ones do), at most
   ``--max_new`` tokens: ``generate(num_samples=8)`` over all prompts in one call (what
   ``--engine_rows 0`` runs) against the engine with 32 and 128 rows (``EngineRollouts``).
   Completion tokens (up to and including the EOS) per second, and the seconds of a rollout.

    python bench/serving.py [--width 256 --layers 4 --vocab 4096 --new 64 --requests 64]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from provenance import print_provenance  # noqa: E402

from redco_zoo_models import LlamaConfig, LlamaForCausalLM, generate  # noqa: E402
from redco_zoo_models.engine import Engine  # noqa: E402
from redco_zoo_models.requests import Sampling  # noqa: E402


def llama(vocab: int, width: int, layers: int) -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=width,
                                        intermediate_size=width * 2, num_hidden_layers=layers,
                                        num_attention_heads=8, num_key_value_heads=4,
                                        max_position_embeddings=4096), nnx.Rngs(0))


def timed(run) -> tuple[float, object]:
    run()  # compile
    start = time.perf_counter()
    out = run()
    return time.perf_counter() - start, out


def serving(args) -> None:
    model = llama(args.vocab, args.width, args.layers)
    params = nnx.state(model, nnx.Param)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, args.vocab, rng.integers(8, 49))) for _ in range(64)]
    width = max(map(len, prompts))
    one = jax.jit(lambda p, ids, mask: generate(model, p, ids, args.new, prompt_mask=mask))

    def one_at_a_time(batch):
        for prompt in batch:
            ids = np.zeros((1, width), np.int32)
            ids[0, width - len(prompt):] = prompt
            one(params, ids, np.arange(width)[None] >= width - len(prompt)).block_until_ready()

    engine = Engine(model, params, max_seqs=args.rows, max_len=width + args.new)
    print(f"1. serving: LLaMA width {args.width}, {args.layers} layers, vocab {args.vocab}; "
          f"{args.new} new tokens a request; engine rows {args.rows}; {jax.default_backend()}")
    print(f"{'requests':>8} {'generate 1 at a time':>22} {'engine':>12} {'engine / generate':>18}")
    for n in (1, 8, 64):
        batch = prompts[:n]
        base_s, _ = timed(lambda: one_at_a_time(batch))
        engine_s, _ = timed(lambda: engine.generate(batch, Sampling(max_tokens=args.new)))
        tokens = n * args.new
        print(f"{n:>8} {tokens / base_s:>16.0f} tok/s {tokens / engine_s:>6.0f} tok/s "
              f"{base_s / engine_s:>17.2f}x")


def rollouts(args) -> None:
    g, eos, vocab = 8, 1, 64
    model = llama(vocab, args.width, args.layers)
    params = nnx.state(model, nnx.Param)
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(3, vocab, rng.integers(8, 17))) for _ in range(args.prompts)]
    width = max(map(len, prompts))
    ids = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = p
    mask = np.arange(width)[None] >= width - np.array([[len(p)] for p in prompts])
    batch = jax.jit(lambda p, key: generate(model, p, ids, args.max_new, prompt_mask=mask,
                                            rng=key, temperature=1.0, eos_token_id=eos,
                                            num_samples=g))

    def counted(tokens) -> int:  # up to and including the first EOS
        tokens = np.asarray(tokens)
        return int((np.cumsum(tokens == eos, 1) - (tokens == eos) == 0).sum())

    print(f"\n2. GRPO rollouts: {args.prompts} prompts x {g} samples, at most {args.max_new} "
          f"new tokens, EOS one of {vocab} tokens")
    print(f"{'sampler':>28} {'seconds':>8} {'completion tok/s':>17} {'tokens':>7}")
    seconds, tokens = timed(lambda: batch(params, jax.random.PRNGKey(0)).block_until_ready())
    base = counted(tokens) / seconds
    print(f"{'generate, one fixed batch':>28} {seconds:>8.2f} {base:>17.0f} {counted(tokens):>7}")
    for rows in (32, 128):
        engine = Engine(model, params, max_seqs=rows, max_len=width + args.max_new,
                        eos_token_ids=(eos,))
        sampling = Sampling(max_tokens=args.max_new, temperature=1.0, n=g, seed=0)
        seconds, requests = timed(lambda: engine.generate(prompts, sampling))
        n = sum(len(s.tokens) for r in requests for s in r.samples)
        print(f"{f'engine, {rows} rows':>28} {seconds:>8.2f} {n / seconds:>17.0f} {n:>7}   "
              f"{n / seconds / base:.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max_new", type=int, default=128)
    args = parser.parse_args()
    print_provenance()
    serving(args)
    rollouts(args)
