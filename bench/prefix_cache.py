"""Prefix caching in the engine, on this machine's CPU (or its accelerator): ``--requests``
requests sharing a ``--system``-token system prompt (each with ``--own`` tokens of its own),
``--new`` tokens each, all submitted at once to an engine of ``--rows`` rows, with and without
``prefix_caching``; each engine warmed up first (compile times left out). Prints the mean time
to first token, the total time, the hits and the prompt tokens reused, and the ratios.

    python bench/prefix_cache.py [--system 512 --own 16 --requests 32 --rows 8 --new 16]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from provenance import print_provenance  # noqa: E402
from serving import llama  # noqa: E402

from redco_zoo_models.engine import Engine  # noqa: E402
from redco_zoo_models.requests import Sampling  # noqa: E402


def run(engine: Engine, prompts: list[list[int]], new: int) -> tuple[float, float]:
    """``(mean seconds to each request's first token, seconds to the last one's end)``."""
    first: dict[int, float] = {}
    record = lambda request, *_: first.setdefault(id(request), time.perf_counter())  # noqa: E731
    start = time.perf_counter()
    requests = [engine.submit(p, Sampling(max_tokens=new, ignore_eos=True), on_token=record)
                for p in prompts]
    engine.run_until_done(requests)
    total = time.perf_counter() - start
    return float(np.mean([first[id(r)] - start for r in requests])), total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("system", 512), ("own", 16), ("requests", 32), ("rows", 8),
                          ("new", 16), ("width", 256), ("layers", 4), ("vocab", 4096)):
        parser.add_argument(f"--{flag}", type=int, default=default)
    args = parser.parse_args()
    print_provenance()
    model = llama(args.vocab, args.width, args.layers)
    params = nnx.state(model, nnx.Param)
    rng = np.random.default_rng(0)
    system = [int(t) for t in rng.integers(3, args.vocab, args.system)]
    prompts = [system + [int(t) for t in rng.integers(3, args.vocab, args.own)]
               for _ in range(args.requests)]
    max_len = args.system + args.own + args.new
    seen = {}
    for caching in (False, True):
        engine = Engine(model, params, max_seqs=args.rows, max_len=max_len,
                        prefix_caching=caching)
        engine.warm_up()
        ttft, total = run(engine, prompts, args.new)
        seen[caching] = ttft, total
        print(f"prefix_caching={caching}: time to first token {ttft:.3f} s (mean of "
              f"{args.requests}), total {total:.3f} s; {engine.prefix_stats or 'no counters'}")
    (t0, s0), (t1, s1) = seen[False], seen[True]
    print(f"with prefix caching: time to first token x{t0 / t1:.2f} faster, total "
          f"x{s0 / s1:.2f} faster ({args.requests} requests, {args.system}-token system prompt)")


if __name__ == "__main__":
    main()
