"""The zoo's sampler (``redco_zoo_models.generate``: a key/value cache, one ``lax.scan``) against
a naive one that runs the whole sequence again for every new token, side by side in one run.

A LLaMA of ``--hidden`` width and ``--layers`` layers (random weights, fp32), ``--batch`` prompts
of ``--prompt`` tokens, greedy, on one CPU device (``XLA_FLAGS=''``). The naive sampler keeps the
sequence in a buffer of fixed length, so it too compiles once
(``tests/zoo/rerun.py::greedy_without_cache``). Each is compiled first, then timed; printed per
number of new tokens: new tokens per second of each, and the ratio. Issue 27's bar: >= 10x at
512 new tokens. The two give the same tokens (checked here, and in ``tests/zoo/test_generation.py``).

    XLA_FLAGS='' python bench/sampler.py [--new 128,512]
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
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "zoo"))
from provenance import print_provenance  # noqa: E402
from rerun import greedy_without_cache  # noqa: E402

from redco_zoo_models import LlamaConfig, LlamaForCausalLM, generate  # noqa: E402


def timed(fn, *args) -> tuple[float, np.ndarray]:
    """Seconds of one call after a first (compiling) one; its result."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return time.perf_counter() - start, np.asarray(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new", default="128,512")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=16)
    args = parser.parse_args()
    print_provenance()
    config = LlamaConfig(vocab_size=512, hidden_size=args.hidden,
                         intermediate_size=args.hidden * 11 // 4, num_hidden_layers=args.layers,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config, nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    prompt = jax.random.randint(jax.random.PRNGKey(1), (args.batch, args.prompt), 0, 512)
    print(f"LLaMA hidden {args.hidden}, {args.layers} layers; {args.batch} prompts of "
          f"{args.prompt} tokens; greedy\n\n| new tokens | cached tokens/s | naive tokens/s | "
          "ratio |\n|---:|---:|---:|---:|")
    for n in map(int, args.new.split(",")):
        cached = jax.jit(lambda p, x, n=n: generate(model, p, x, n))
        cached_s, cached_tokens = timed(cached, params, prompt)
        naive_s, naive_tokens = timed(lambda x, n=n: greedy_without_cache(model, x, n), prompt)
        assert (cached_tokens == naive_tokens).all(), "the two samplers disagree"
        new = args.batch * n
        print(f"| {n} | {new / cached_s:,.0f} | {new / naive_s:,.0f} | "
              f"{naive_s / cached_s:,.1f}x |", flush=True)


if __name__ == "__main__":
    main()
