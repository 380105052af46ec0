"""The corpus loader against the train step: throughput, step time, packing, time to resume.

Four measurements, each a ratio of two sides measured in the same run, on one CPU device
(``XLA_FLAGS=''``), every timed side in a fresh process. The corpus is ``bench/corpus_memory.py``'s:
random documents of 10-3,000 tokens (vocabulary 512, uint16, each ending in EOS), a small file
(``--small_gb``) for 1-3 and a 4 GB one for 4, written once into ``--dir`` (reused if there).
The model is the LM demo's LLaMA (``zoo/lm/redco_zoo_lm/demo.py``: hidden 128, 2 layers,
intermediate 352), with the corpus's vocabulary of 512, trained on rows of ``--seq_len`` + 1
tokens, ``--batch`` rows an update (the demo's 8), through ``Trainer.fit``.

1. Loader throughput: rows per second that ``PackedRows`` over a ``TokenFile`` makes alone (rows
   read at random positions, ``--batch`` at a time through ``redco_zoo_lm.pipeline.collate_fn``),
   against the rows per second the train loop consumes (``--batch`` / the in-memory median
   update time of 2). Target: >= 20x.
2. Step time with the loader attached: ``fit`` over a ``RowsView`` of ``PackedRows`` (each row
   read from disk when its batch is made) against ``fit`` over a list of the very same row dicts
   read beforehand (``list(view)``): same seed, model and ``--updates``; per-update time is the
   interval between consecutive ``on_train_batch_start`` hooks, the first (compile) left out;
   the median per run, the two run alternately ``--repeats`` times, the medians of those
   compared. Also printed: the median ``data`` phase (``on_time_spent``) of each, and the
   ratio the loader alone accounts for, 1 + (loader data - in-memory data) / update, which the
   scheduling noise of a shared machine (whole-update medians move by its 4 ms ticks) does not
   reach. Target: <= 1.02.
3. Packing efficiency: the share of row tokens that are real tokens, rows of 2,048, for
   ``PackedRows`` (1 - ``padding_share``) against each document alone in its own padded row(s).
   Target: >= 98%.
4. Time to the first batch after a resume on the 4 GB file: a fresh process trains the tiny
   model of ``corpus_memory.py`` (hidden 64) on its rows of 2,048 with ``save_every_n_steps=2``
   and stops after update 3; another fresh process then resumes that fit, timed from just
   before the parent starts it to the end of the first batch's ``data`` phase, broken down into
   interpreter start, imports, ``TokenFile`` scan, ``PackedRows`` plan, model and ``Trainer``
   made, fit's startup and resume, the first batch. The file was just read by the first
   process: its scan reads the page cache. Target: < 5 s.

    python bench/corpus_loader.py [--dir /tmp/redco-corpus] [--updates 40] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from corpus_memory import EOS, ROW, VOCAB, make_file  # noqa: E402


class FirstBatch(Exception):
    """Raised by the probe once the first batch of a resumed fit is made: nothing more to time."""


def make_probe(stop_at_first_batch: bool = False):
    """An observer noting when each batch starts and each ``data`` phase's seconds."""
    import redco

    class Probe:
        def __init__(self):
            self.starts, self.data, self.data_end = {}, {}, None

        @redco.hookimpl
        def on_train_batch_start(self, step):
            self.starts[step] = time.time()

        @redco.hookimpl
        def on_time_spent(self, phase, seconds, step):
            if phase == "data":
                self.data[step], self.data_end = seconds, time.time()
                if stop_at_first_batch:
                    raise FirstBatch(step)
    return Probe()


def make_trainer(hidden: int, workdir: str, callbacks=()):
    """The demo's LLaMA (hidden 128) or ``corpus_memory.py``'s tiny one (hidden 64), vocabulary
    512, in a ``Trainer`` on one device."""
    import optax
    from flax import nnx

    from redco import Deployer, Trainer
    from redco_zoo_lm.pipeline import collate_fn, loss_fn
    from redco_zoo_models import LlamaConfig, LlamaForCausalLM, split_model
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    apply_fn, params = split_model(LlamaForCausalLM(config, rngs=nnx.Rngs(0)))
    return Trainer(Deployer(jax_seed=0, workdir=workdir, verbose=False), collate_fn, apply_fn,
                   loss_fn, params, optax.adamw(1e-3), callbacks=callbacks)


def open_rows(path: str, seq_len: int):
    from redco_zoo_lm.corpus import TokenFile
    from redco_zoo_lm.packing import PackedRows
    return PackedRows(TokenFile(path, EOS, vocab_size=VOCAB), seq_len)


def loader_worker(args) -> dict:
    """Rows per second of ``PackedRows`` + ``collate_fn`` alone, rows in a random order."""
    from redco_zoo_lm.pipeline import collate_fn
    rows = open_rows(args.path, args.seq_len)
    n = min(args.loader_rows, len(rows)) // args.batch * args.batch
    order = np.random.default_rng(1).permutation(len(rows))[:n]
    collate_fn([rows[int(i)] for i in order[:args.batch]])  # the file opened once, first
    start = time.perf_counter()
    for b in range(0, n, args.batch):
        collate_fn([rows[int(i)] for i in order[b:b + args.batch]])
    return {"rows": n, "rows_per_s": n / (time.perf_counter() - start)}


def fit_worker(args) -> dict:
    """Median seconds an update (compile left out), and of its ``data`` phase, over ``fit``
    fed from disk (``--side loader``) or from the same rows held in a list (``memory``)."""
    from redco_zoo_lm.packing import RowsView
    rows = open_rows(args.path, args.seq_len)
    order = np.random.default_rng(1).permutation(len(rows))[:args.updates * args.batch]
    examples = RowsView(rows, order)
    if args.side == "memory":
        examples = list(examples)
    probe = make_probe()
    make_trainer(128, args.workdir, [probe]).fit(examples, args.batch, n_epochs=1)
    starts = [probe.starts[s] for s in sorted(probe.starts)]
    return {"update_s": float(np.median(np.diff(starts)[1:])),
            "data_s": float(np.median([probe.data[s] for s in sorted(probe.data)[1:]]))}


def resume_train_worker(args) -> dict:
    """Train the tiny model on the 4 GB file's rows of 2,048 until a step checkpoint exists."""
    import redco

    class StopAfter3:
        @redco.hookimpl
        def on_step_end(self, step):
            if step == 3:
                raise FirstBatch(step)
    rows = open_rows(args.path, ROW - 1)
    try:
        make_trainer(64, args.workdir, [StopAfter3()]).fit(rows, 1, n_epochs=1,
                                                            save_every_n_steps=2)
    except FirstBatch:
        pass
    return {"checkpoints": sorted(os.listdir(os.path.join(args.workdir, "ckpts")))}


def resume_first_worker(args, began: float) -> dict:
    """Seconds from the parent's launch to each point on the way to the resumed first batch."""
    marks = {"interpreter": began}
    import redco  # noqa: F401
    from redco_zoo_lm.corpus import TokenFile
    from redco_zoo_lm.packing import PackedRows
    marks["imports"] = time.time()
    corpus = TokenFile(args.path, EOS, vocab_size=VOCAB)
    marks["scan"] = time.time()
    rows = PackedRows(corpus, ROW - 1)
    marks["plan"] = time.time()
    probe = make_probe(stop_at_first_batch=True)
    trainer = make_trainer(64, args.workdir, [probe])
    marks["trainer"] = time.time()
    try:
        trainer.fit(rows, 1, n_epochs=1, save_every_n_steps=2)
    except FirstBatch:
        pass
    (step, started), = probe.starts.items()
    marks["resume"], marks["first_batch"] = started, probe.data_end
    seconds, last = {}, args.launched
    for name, at in marks.items():
        seconds[name], last = at - last, at
    return {"resumed_at_update": step, "seconds": seconds, "total_s": last - args.launched}


def run_worker(kind: str, args, **flags) -> dict:
    """``kind``'s worker in a fresh process on one CPU device; what it printed last, as JSON."""
    argv = [f"--{k}={v}" for k, v in {"path": args.path, "seq_len": args.seq_len,
                                       "batch": args.batch, "updates": args.updates,
                                       "loader_rows": args.loader_rows, **flags}.items()]
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    launched = time.time()
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", kind, *argv,
                          f"--launched={launched!r}"], capture_output=True, text=True, env=env)
    if out.returncode:
        sys.exit(f"worker {kind} {flags}: failed\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def step_time(args, scratch: str) -> dict:
    """Measurement 2: the two sides alternately, ``--repeats`` times each."""
    runs = {"loader": [], "memory": []}
    for repeat in range(args.repeats):
        for side in runs:
            r = run_worker("fit", args, side=side, workdir=os.path.join(scratch, f"{side}{repeat}"))
            runs[side].append(r)
            print(f"  fit, {side}, repeat {repeat + 1}: update {r['update_s'] * 1e3:.1f} ms, "
                  f"data {r['data_s'] * 1e3:.2f} ms", flush=True)
    return {side: {key: float(np.median([r[key] for r in rs])) for key in rs[0]}
            for side, rs in runs.items()}


def packing(path: str) -> dict:
    """Measurement 3: real tokens / row tokens, rows of 2,048, packed against one doc a row."""
    rows = open_rows(path, ROW - 1)
    lengths = rows.corpus.lengths
    padded = -(-lengths // ROW) * ROW
    return {"documents": len(lengths), "packed": 1 - rows.padding_share,
            "padded": lengths.sum() / padded.sum()}


def time_to_resume(args, scratch: str) -> dict:
    """Measurement 4 on the 4 GB file: a fit stopped after a checkpoint, then resumed."""
    path = os.path.join(args.dir, "random_4gb.bin")
    if not os.path.exists(path):
        make_file(path, 4)
    workdir = os.path.join(scratch, "resume")
    trained = run_worker("resume_train", args, path=path, workdir=workdir)
    print(f"  trained until update 3 on {path}: {trained['checkpoints']}", flush=True)
    return run_worker("resume_first", args, path=path, workdir=workdir)


def run_as_worker(args, began: float) -> None:
    work = {"loader": loader_worker, "fit": fit_worker, "resume_train": resume_train_worker,
            "resume_first": lambda a: resume_first_worker(a, began)}[args.worker]
    print(json.dumps(work(args)), flush=True)


def report(args, loader: dict, steps: dict, packed: dict, resumed: dict) -> None:
    step_rows = args.batch / steps["memory"]["update_s"]
    print(f"\n1. loader throughput (rows of {args.seq_len + 1}, batches of {args.batch}): "
          f"loader {loader['rows_per_s']:,.0f} rows/s, train step {step_rows:,.1f} rows/s, "
          f"ratio {loader['rows_per_s'] / step_rows:,.1f}x (target >= 20x)")
    lo, mem = steps["loader"], steps["memory"]
    extra = lo["data_s"] - mem["data_s"]  # reading rows from disk: what the loader adds
    print(f"2. median update over {args.updates} updates, {args.repeats} repeats: loader "
          f"{lo['update_s'] * 1e3:.2f} ms (data {lo['data_s'] * 1e3:.2f} ms), in memory "
          f"{mem['update_s'] * 1e3:.2f} ms (data {mem['data_s'] * 1e3:.2f} ms), ratio "
          f"{lo['update_s'] / mem['update_s']:.3f} (target <= 1.02); the loader's own share, "
          f"(update + data difference) / update: {1 + extra / mem['update_s']:.4f}")
    print(f"3. real tokens / row tokens, {packed['documents']:,} documents of 10-3,000 tokens "
          f"in rows of {ROW}: packed {packed['packed']:.2%}, one document a row "
          f"{packed['padded']:.2%}, ratio {packed['packed'] / packed['padded']:.2f}x "
          "(target >= 98% packed)")
    parts = ", ".join(f"{k} {v:.2f}" for k, v in resumed["seconds"].items())
    print(f"4. resume on 4 GB, to the first batch (of update {resumed['resumed_at_update']}): "
          f"{resumed['total_s']:.2f} s (target < 5 s) = {parts}")


def main() -> None:
    began = time.time()
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp/redco-corpus")
    parser.add_argument("--small_gb", type=float, default=0.05)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--updates", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--loader_rows", type=int, default=20_000)
    for hidden in ("--worker", "--side", "--path", "--workdir"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--launched", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return run_as_worker(args, began)
    from provenance import print_provenance
    print_provenance()
    os.makedirs(args.dir, exist_ok=True)
    args.path = os.path.join(args.dir, f"random_{args.small_gb:g}gb.bin")
    if not os.path.exists(args.path):
        make_file(args.path, args.small_gb)
    with tempfile.TemporaryDirectory(prefix="corpus-loader-") as scratch:
        steps = step_time(args, scratch)
        loader = run_worker("loader", args)
        print(f"  loader alone: {loader['rows_per_s']:,.0f} rows/s", flush=True)
        packed = packing(args.path)
        resumed = time_to_resume(args, scratch)
    report(args, loader, steps, packed, resumed)


if __name__ == "__main__":
    main()
