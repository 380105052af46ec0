"""Grain's checkpointed iterators resumed on another process count or batch size: exact, refused,
or silently wrong. The measurement behind "Why not Grain" (docs/tutorials/pretrain.md).

1000 integers, ``grain.MapDataset.source(...).shuffle(seed=42)``; a pipeline of ``n`` shards is
run for 10 batches per shard, its state saved (``get_state``), then a pipeline of another shard
count or batch size is built and given that state (``set_state``) and run to its end. Printed per
case: the elements consumed before the checkpoint, after it, how many of the earlier ones came
again (repeated), and how many never came (skipped). Two pipelines:

1. ``grain.experimental.ElasticIterator(ds, global_batch_size, ShardOptions(i, n))``: its state
   is one global index; the elements a batch size leaves at the end are skipped by it with or
   without a checkpoint (its ``drop_remainder``).
2. A plain shard slice, ``ds[i::n].to_iter_dataset().batch(b)``, shard ``i`` restored with the
   state of old shard ``i % n_old``: its state is a position inside its own slice.

Needs grain (PyPI ``grain``, not a dependency of this repository: a venv of its own will do):

    pip install grain==0.2.18 numpy && python bench/grain_resume.py
"""
from __future__ import annotations

import collections
import logging
import os
import sys

import numpy as np

N, K = 1000, 10  # elements, batches per shard before the checkpoint


def base():
    import grain
    return grain.MapDataset.source(list(range(N))).shuffle(seed=42)


def flat(batches) -> list[int]:
    return [int(x) for b in batches for x in np.asarray(b).ravel()]


def run_all(make_iter, count: int, steps: int | None = None):
    """Each of ``count`` shards' iterators run (for ``steps`` batches); theirs and all elements."""
    out, its = [], [make_iter(i) for i in range(count)]
    for it in its:
        for n, batch in enumerate(it, start=1):
            out.append(batch)
            if n == steps:
                break
    return its, flat(out)


def report(name: str, seen: list[int], after: list[int]) -> None:
    counts, seen_set = collections.Counter(after), set(seen)
    repeated = sum(v for k, v in counts.items() if k in seen_set) + \
        sum(v - 1 for v in counts.values() if v > 1)
    skipped = len(set(range(N)) - seen_set - set(counts))
    verdict = "exact" if not repeated and not skipped else "WRONG"
    print(f"  {name}: {len(seen)} before, {len(after)} after; repeated {repeated}, skipped "
          f"{skipped}: {verdict}")


def elastic(old_n: int, old_gbs: int, new_n: int, new_gbs: int) -> None:
    from grain.experimental import ElasticIterator
    from grain.sharding import ShardOptions

    def make(gbs: int, n: int, state=None):
        def one(i: int):
            it = iter(ElasticIterator(base(), gbs, ShardOptions(i, n)))
            if state is not None:
                it.set_state(state)
            return it
        return one
    its, seen = run_all(make(old_gbs, old_n), old_n, K)
    _, after = run_all(make(new_gbs, new_n, its[0].get_state()), new_n)
    report(f"shards {old_n} -> {new_n}, global batch {old_gbs} -> {new_gbs}", seen, after)


def delivered(global_batch_size: int) -> int:
    """Elements one uninterrupted ``ElasticIterator`` pass delivers."""
    from grain.experimental import ElasticIterator
    from grain.sharding import ShardOptions
    return len(flat(iter(ElasticIterator(base(), global_batch_size, ShardOptions(0, 1)))))


def plain(old_n: int, old_b: int, new_n: int, new_b: int) -> None:
    def make(n: int, b: int):
        return lambda i: iter(base()[i::n].to_iter_dataset().batch(b))
    its, seen = run_all(make(old_n, old_b), old_n, K)
    states = [it.get_state() for it in its]

    def restored(i: int):
        it = make(new_n, new_b)(i)
        it.set_state(states[i % old_n])
        return it
    _, after = run_all(restored, new_n)
    report(f"shards {old_n} -> {new_n}, batch per shard {old_b} -> {new_b}", seen, after)


def guarded(fn, *args) -> None:
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - a refusal is a result here
        print(f"  {args}: refused: {type(e).__name__}: {e}")


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from provenance import print_provenance
    print_provenance()
    import grain
    logging.disable(logging.WARNING)
    print(f"grain {grain.__version__ if hasattr(grain, '__version__') else '?'}\n")
    print("1. ElasticIterator")
    for case in [(2, 8, 2, 8), (2, 8, 4, 8), (2, 8, 1, 8), (2, 8, 4, 4), (2, 8, 2, 16),
                 (2, 8, 4, 6)]:
        guarded(elastic, *case)
    for gbs in (8, 16):
        print(f"  no checkpoint, global batch {gbs}: {delivered(gbs)} of {N} delivered")
    print("2. a plain shard slice")
    for case in [(2, 4, 2, 4), (2, 4, 2, 8), (2, 4, 4, 4), (2, 4, 1, 4), (2, 4, 1, 8)]:
        guarded(plain, *case)


if __name__ == "__main__":
    main()
