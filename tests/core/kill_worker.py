"""One training command for the kill tests (tests/core/test_kill_resume.py, orbax, and
tests/formats/test_format_kill_resume.py, every format):
``kill_worker.py WORKDIR [--format NAME] [--kill POINT]``.

Trains helpers' tiny LLaMA-style LM (2 model shards on 8 simulated CPU devices, 3 epochs of 4
updates, a step checkpoint every 3 updates and at each epoch's end, the last 2 kept), resuming
from WORKDIR's checkpoints like any rerun of the same command, and writes the final params to
WORKDIR/final.npz. With ``--kill POINT`` the process dies at

* ``step:N``  - SIGKILL in ``on_step_end`` for update N (before any checkpoint of N is written;
  once the background write of an earlier one, if any, is complete);
* ``create:N`` - while the real writer of the format (``--format``, default ``orbax``) is saving
  checkpoint ``step_N``, at its first write of data into any file: the files it has created by
  then are empty, and no meta.json exists;
* ``write:N`` - while that writer is saving ``step_N``, at the write that would take a file past
  half the size of the biggest file of the newest complete checkpoint: that file is left cut at
  exactly that size, with more still to write (a writer that first sizes a file to its full
  length, as safetensors does, is stopped at that sizing, the file still empty);
* ``saved:N`` - SIGKILL in ``on_checkpoint_saved`` for ``step_N`` (renamed into place and pruned);
* ``term:N``  - SIGTERM in ``on_step_end`` for update N (a preemption notice): training stops
  cleanly, with a checkpoint of the step it stopped after and exit status 143;
* ``term-save:N`` - two SIGTERMs while the format is writing ``step_N`` (the second one must not
  cut the save), then the same clean stop;
* ``int:N``, ``int2:N`` - Ctrl-C (SIGINT) once in ``on_step_end`` for update N (the same clean
  stop, status 130), or twice (exits at once);
* ``held:N`` - the background write of ``step_N`` is held once the format has written its files
  (before redco's meta.json and rename), and SIGKILL comes in ``on_step_end`` for update N+1,
  once the write is held: training went on while the write was in flight (a write that blocked
  training would never get there);
* ``term-held:N`` - the same hold, then SIGTERM in ``on_step_end`` for update N+1; the write
  stays held until the trainer waits for it (``trainer.checkpoints.join``), so a stop that
  saves ``step_<N+2>`` without waiting starts that write with ``step_N`` unfinished, which is
  printed ("began with step_N still being written"); the stop saves and exits 143.

The saves killed through the file-size limit (``create``, ``write``, ``term-save``) are written
while training waits (``Deployer(async_checkpoints=False)``): the limit is the whole process's,
and a write of the training thread in the meantime (a log line) would be stopped first. So is
``saved``, whose kill comes right after the save, before the next update (in the background,
``on_checkpoint_saved`` would come an update or two later).

``create`` and ``write`` stop the format's own writing (tensorstore threads for orbax, Rust for
safetensors, Python for msgpack) inside the write(2) call, wherever it is made: just before the
real ``save`` starts, the process's file-size limit (RLIMIT_FSIZE) is set to that size and
SIGXFSZ restored to its default action, so the kernel terminates the whole process (as abruptly
as SIGKILL: no handler, no cleanup) the moment any write would go past the limit.

With ``--data packed`` it trains on a token file instead (written into WORKDIR once, the same
bytes every time): 64 documents packed two to a row, 32 rows of 17 tokens, read from disk
(``redco_zoo_lm``'s ``TokenFile`` and ``PackedRows``), the same schedule of updates.

Every start appends the step training starts from (after any resume) to WORKDIR/starts.txt.
"""
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import re  # noqa: E402
import resource  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/core, for helpers

import numpy as np  # noqa: E402
import optax  # noqa: E402
from ckpt_helpers import WRITE_LIMITS  # noqa: E402
from helpers import GLOBAL_BATCH, lm_collate, lm_examples, lm_loss, lm_model  # noqa: E402

import redco  # noqa: E402
from redco import Deployer, Trainer, plugins  # noqa: E402
from redco.protocols import CheckpointFormat  # noqa: E402
from redco.sharding import named_leaves  # noqa: E402

N_EXAMPLES, N_EPOCHS, SAVE_EVERY, KEEP = 32, 3, 3, 2  # 4 updates an epoch, 12 in all
STEPS_PER_EPOCH = N_EXAMPLES // GLOBAL_BATCH


def die(why: str) -> None:
    print(f"kill_worker: SIGKILL {why}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


class KillingFormat(CheckpointFormat):
    """Registered under the name of the format it wraps, after that one (so it wins): the real
    format, except that its save of ``step_<kill_step>`` runs under a file-size limit of
    ``limit(ckpt_dir)`` bytes, so that the kernel kills the process part way through it."""

    def __init__(self, name, kill_step, limit, term_step=None, hold_step=None):
        self.name, self.kill_step, self.limit = name, kill_step, limit
        self.term_step, self.hold_step = term_step, hold_step
        self.holding, self.release = threading.Event(), threading.Event()
        self.real = plugins.lookup("checkpoint_formats", name)

    @redco.hookimpl
    def register_checkpoint_formats(self, register):
        register(self.name, self)

    def save(self, path, tree):
        ckpt = os.path.dirname(path)  # <ckpt_dir>/step_N.tmp
        m = re.match(r"step_(\d+)", os.path.basename(ckpt))
        if m and int(m.group(1)) == self.term_step:
            for _ in range(2):
                os.kill(os.getpid(), signal.SIGTERM)
            print(f"kill_worker: sent two SIGTERMs while writing {path}", flush=True)
        if m and int(m.group(1)) == self.hold_step:
            self.real.save(path, tree)
            print(f"kill_worker: holding the write of {path}", flush=True)
            self.holding.set()
            self.release.wait()  # until term-held's SIGTERM; held: until the SIGKILL
            return None
        if self.holding.is_set() and not self.release.is_set():
            print(f"kill_worker: the write of {path} began with step_{self.hold_step} still "
                  "being written", flush=True)
            self.release.set()
        if not (m and int(m.group(1)) == self.kill_step):
            return self.real.save(path, tree)
        limit = self.limit(os.path.dirname(ckpt))
        print(f"kill_worker: writing {path} with files limited to {limit} bytes", flush=True)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it: writes would fail
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
        self.real.save(path, tree)
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        sys.exit(f"kill_worker: the {self.name} writer finished {path} without writing past "
                 f"{limit} bytes")

    def load(self, path, target):
        return self.real.load(path, target)


class Killer:
    """Per-run callbacks: record where training starts; SIGKILL at ``step:N`` / ``saved:N``."""

    def __init__(self, workdir, point, n, fmt):
        self.workdir, self.point, self.n, self.fmt = workdir, point, n, fmt

    @redco.hookimpl
    def on_fit_start(self, trainer, n_epochs, steps_per_epoch):
        with open(os.path.join(self.workdir, "starts.txt"), "a") as f:
            f.write(f"{trainer.step}\n")

    @redco.hookimpl
    def on_step_end(self, trainer, step, metrics):
        if self.point == "step" and step == self.n:
            trainer.checkpoints.join()  # between checkpoints: none in flight (see held:N)
            die(f"at the end of step {step}")
        if self.point == "held" and step == self.n + 1:
            if not self.fmt.holding.wait(timeout=120):  # the writer thread may start late
                sys.exit(f"kill_worker: the write of step_{self.n} never reached its hold")
            die(f"at the end of step {step}, the write of step_{self.n} in flight")
        if self.point == "term-held" and step == self.n + 1:
            checkpoints, join = trainer.checkpoints, trainer.checkpoints.join

            def released_then_joined():  # the trainer waits for the held write: release it
                self.fmt.release.set()
                join()
            checkpoints.join = released_then_joined
            os.kill(os.getpid(), signal.SIGTERM)
        if self.point in ("term", "int", "int2") and step == self.n:
            signum = signal.SIGTERM if self.point == "term" else signal.SIGINT
            for _ in range(2 if self.point == "int2" else 1):
                os.kill(os.getpid(), signum)

    @redco.hookimpl
    def on_checkpoint_saved(self, trainer, path, step):
        if self.point == "saved" and step == self.n:
            die(f"just after saving {path}")


def packed_rows(workdir: str):
    """``N_EXAMPLES`` rows of 17 tokens on disk, each packing a document of 12 tokens and one of
    5 (EOS included), every id below helpers' vocabulary of 32."""
    from redco_zoo_lm.corpus import TokenFile, write_token_file
    from redco_zoo_lm.packing import PackedRows
    path = os.path.join(workdir, "corpus.bin")
    if not os.path.exists(path):
        rng = np.random.default_rng(0)
        docs = [rng.integers(1, 32, n - 1) for n in [12, 5] * N_EXAMPLES]
        os.replace(write_token_file(path + ".tmp", docs, eos_id=0), path)
    rows = PackedRows(TokenFile(path, eos_id=0, vocab_size=32), seq_len=16)
    assert len(rows) == N_EXAMPLES and rows.padding_share == 0, (len(rows), rows.padding_share)
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir")
    parser.add_argument("--format", default="orbax", help="the checkpoint format to write")
    parser.add_argument("--kill", default=None, help="step:N, create:N, write:N, saved:N, "
                        "term:N, term-save:N, int:N or int2:N")
    parser.add_argument("--data", default="list", choices=["list", "packed"])
    args = parser.parse_args()
    point, n = (None, None)
    if args.kill:
        point, n = args.kill.split(":")
        n = int(n)
        assert point in ("step", "create", "write", "saved", "term", "term-save", "int", "int2",
                         "held", "term-held"), args.kill
    os.makedirs(args.workdir, exist_ok=True)

    limit = WRITE_LIMITS.get(point)  # None: no save is stopped
    fmt = KillingFormat(args.format, n if limit else None, limit,
                        n if point == "term-save" else None,
                        n if point in ("held", "term-held") else None)
    plugins.pm.register(fmt)
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=args.workdir, verbose=False,
                        checkpoint_format=args.format,
                        async_checkpoints=point not in ("create", "write", "term-save", "saved"))
    apply_fn, params = lm_model()
    trainer = Trainer(deployer, lm_collate, apply_fn, lm_loss, params, optax.adamw(1e-2),
                      callbacks=[Killer(args.workdir, point, n, fmt)])
    examples = lm_examples(N_EXAMPLES) if args.data == "list" else packed_rows(args.workdir)
    trainer.fit(examples, GLOBAL_BATCH // deployer.dp_size, n_epochs=N_EPOCHS,
                save_every_n_steps=SAVE_EVERY, keep_last_ckpts=KEEP)

    arrays = {path: np.asarray(x) for path, x in named_leaves(jax.device_get(trainer.params))}
    arrays["__step__"] = np.asarray(trainer.step)
    tmp = os.path.join(args.workdir, "final.tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, os.path.join(args.workdir, "final.npz"))
    print(f"kill_worker: finished at step {trainer.step}", flush=True)


if __name__ == "__main__":
    main()
