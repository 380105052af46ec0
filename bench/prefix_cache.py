"""Prefix caching in the engine, on this machine's CPU (or its accelerator): ``--requests``
requests sharing a ``--system``-token system prompt (each with ``--own`` tokens of its own),
``--new`` tokens each, all submitted at once to an engine of ``--rows`` rows, with and without
``prefix_caching``; each engine warmed up first (compile times left out). Prints the mean time
to first token, the total time, the hits and the prompt tokens reused, and the ratios.

    python bench/prefix_cache.py [--system 512 --own 16 --requests 32 --rows 8 --new 16]

``--grpo``: a GRPO round's rollouts instead, as ``redco_zoo_grpo.engine_rollouts`` submits them:
``--requests`` prompts (a ``--system``-token prefix shared by all, as a chat template and an
instruction are, and ``--own`` tokens each), ``--samples`` sampled completions each (``n``: a
prompt's samples share one prefill with or without the cache), a seed a prompt, up to ``--new``
tokens ended by an end token (one of 64 token ids), the params set again before each round (as
GRPO lends each round's: the cache is emptied). Per engine (slots, and pages of 16 with
``--page_size 16``), with and without ``prefix_caching`` in alternating rounds: the median over ``--rounds``
timed rounds (after a warm-up and one untimed round) and the cache's counters of one round.

    python bench/prefix_cache.py --grpo [--system 64 --own 32 --requests 16 --samples 8
                                         --rows 32 --new 64 --rounds 3 --page_size 16]
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


def grpo_round(engine: Engine, params, prompts: list[list[int]], args) -> tuple[float, dict]:
    """One GRPO round's rollouts: ``(seconds, the prefix cache's counters of this round)``."""
    engine.params = params  # (a new round's weights: the cache emptied, as GRPO's)
    before = engine.prefix_stats
    start = time.perf_counter()
    engine.run_until_done([engine.submit(p, Sampling(
        max_tokens=args.new, temperature=1.0, n=args.samples, seed=i))
        for i, p in enumerate(prompts)])
    seconds = time.perf_counter() - start
    return seconds, {k: v - before.get(k, 0) for k, v in engine.prefix_stats.items()}


def grpo(model, params, system: list[int], rng, args) -> None:
    """``--grpo``'s runs (module docstring), printed a line each: per cache layout, the engines
    with and without prefix caching timed in alternating rounds (the box's load moves both)."""
    prompts = [system + [int(t) for t in rng.integers(3, args.vocab, args.own)]
               for _ in range(args.requests)]
    page = args.page_size or 1  # (max_len a whole number of pages, in both engines)
    max_len = -(-(args.system + args.own + args.new) // page) * page
    print(f"GRPO round: {args.requests} prompts x {args.samples} samples, {args.system}-token "
          f"shared prefix + {args.own} own, up to {args.new} new (end: one of 64 ids), "
          f"{args.rows} rows; median of {args.rounds} rounds, alternating")
    for page_size in dict.fromkeys([None, args.page_size]):
        engines = {caching: Engine(model, params, max_seqs=args.rows, max_len=max_len,
                                   eos_token_ids=tuple(range(3, 67)), prefix_caching=caching,
                                   page_size=page_size) for caching in (False, True)}
        runs = {False: [], True: []}
        for i in range(args.rounds + 1):  # (the first: untimed, first-call costs)
            for caching, engine in engines.items():
                if i == 0:
                    engine.warm_up()
                runs[caching].append(grpo_round(engine, params, prompts, args))
        where = "slots" if page_size is None else f"pages of {page_size}"
        median = {c: float(np.median([s for s, _ in r[1:]])) for c, r in runs.items()}
        for caching in (False, True):
            print(f"  {where:>12}  prefix_caching={caching!s:5}  round {median[caching]:.3f} s"
                  f"  {runs[caching][-1][1] or ''}")
        saved = median[False] - median[True]
        print(f"  {'':>12}  saved {saved:.3f} s a round ({saved / median[False]:.1%})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("system", 512), ("own", 16), ("requests", 32), ("rows", 8),
                          ("new", 16), ("width", 256), ("layers", 4), ("vocab", 4096),
                          ("samples", 8), ("rounds", 3), ("page_size", 16)):
        parser.add_argument(f"--{flag}", type=int, default=default)
    parser.add_argument("--grpo", action="store_true", help="a GRPO round's rollouts")
    args = parser.parse_args()
    print_provenance()
    model = llama(args.vocab, args.width, args.layers)
    params = nnx.state(model, nnx.Param)
    rng = np.random.default_rng(0)
    system = [int(t) for t in rng.integers(3, args.vocab, args.system)]
    if args.grpo:
        return grpo(model, params, system, rng, args)
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
