"""One process of a multi-process run on 127.0.0.1: ``python worker.py PROCESS_ID N_PROCESSES PORT
DEVICES_PER_PROCESS WORKDIR``, or ``python worker.py detect DEVICES_PER_PROCESS WORKDIR`` to let
``Deployer`` detect its launcher (a SLURM step, the ``REDCO_*`` variables). Trains the tiny LM
of ``tests/core/helpers.py`` with ``n_model_shards=2`` at a global batch of 8, predicts, saves a
checkpoint (``REDCO_TEST_CKPT_FORMAT``; resuming from one found in WORKDIR; after
``REDCO_TEST_EPOCHS`` epochs, 2 by default; ``REDCO_TEST_KILL_AT_STEP``/``_TERM_AT_STEP``: this
process gets SIGKILL/SIGTERM at the end of that step; ``REDCO_TEST_CONTEXT_SHARDS``: each
sequence split over that many devices; ``REDCO_TEST_BLOCKING_CKPTS=1``: step checkpoints written
while training waits (``async_checkpoints=False``); ``REDCO_TEST_TERM_DURING_SAVE``: this
process holds its save of that step's checkpoint midway (the state written into ``step_N.tmp``;
meta.json and the rename still to come), prints ``save of step_N in progress``, and goes on only
once ``WORKDIR/go_on_saving`` exists (the test sends its SIGTERMs first), printing what the test
wrote there and whether ``step_N.tmp`` was still unfinished then; ``REDCO_TEST_HANG_AT_STEP``:
this process's ``on_step_end`` of that step never returns; ``REDCO_TEST_STOPPABLE_AT_STEP``: at
the end of that step, once this process's heartbeat says so, it prints ``heartbeat says step N``
and waits there, its hang watch paused, for the test's SIGSTOP; ``REDCO_HANG_TIMEOUT``, as users
set it), prints ``finished step N`` after each step, and writes what it saw (and which launcher
it detected) to ``WORKDIR/result_<PROCESS_ID>.json`` (process 0 also writes the final params as
``.npz``)."""
import json
import os
import signal
import sys
import threading
import time

DETECT = sys.argv[1] == "detect"
if DETECT:
    process_id = n_processes = port = None
    n_devices, workdir = sys.argv[2:4]
else:
    process_id, n_processes, port, n_devices, workdir = sys.argv[1:6]
KILL_AT_STEP = int(os.environ.get("REDCO_TEST_KILL_AT_STEP", 0))  # this process dies there
TERM_AT_STEP = int(os.environ.get("REDCO_TEST_TERM_AT_STEP", 0))  # this process gets SIGTERM
TERM_DURING_SAVE = int(os.environ.get("REDCO_TEST_TERM_DURING_SAVE", 0))
HANG_AT_STEP = int(os.environ.get("REDCO_TEST_HANG_AT_STEP", 0))  # a callback deadlocks there
STOPPABLE_AT_STEP = int(os.environ.get("REDCO_TEST_STOPPABLE_AT_STEP", 0))  # waits for SIGSTOP
N_EPOCHS = int(os.environ.get("REDCO_TEST_EPOCHS", 2))
CKPT_FORMAT = os.environ.get("REDCO_TEST_CKPT_FORMAT", "orbax")
BLOCKING_CKPTS = os.environ.get("REDCO_TEST_BLOCKING_CKPTS") == "1"  # written while training waits
CONTEXT_SHARDS = int(os.environ.get("REDCO_TEST_CONTEXT_SHARDS", 1))  # devices per sequence
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count={n_devices}")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "core"))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from helpers import GLOBAL_BATCH, Recorder, lm_examples, lm_model  # noqa: E402

import redco  # noqa: E402
from redco import Deployer, Trainer  # noqa: E402
from redco.protocols import CheckpointFormat  # noqa: E402
from redco.sharding import named_leaves  # noqa: E402
from redco_zoo_lm import collate_fn, loss_fn  # noqa: E402


class CountedReads(list):
    """The examples, counting the ones read one by one (training reads them so)."""
    reads = 0

    def __getitem__(self, i):
        if not isinstance(i, slice):
            self.reads += 1
        return super().__getitem__(i)


class KillAt:
    @redco.hookimpl
    def on_step_end(self, trainer, step, metrics):
        print(f"finished step {step}", flush=True)
        if step == KILL_AT_STEP:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == TERM_AT_STEP:
            os.kill(os.getpid(), signal.SIGTERM)
        if step == HANG_AT_STEP:
            print(f"hangs at {time.time()}", flush=True)
            threading.Event().wait()
        if step == STOPPABLE_AT_STEP:
            with trainer.hang_watch_paused():
                wait_for_own_heartbeat(step)
                print(f"heartbeat says step {step}", flush=True)
                threading.Event().wait()


def wait_for_own_heartbeat(step: int) -> None:
    """Until this process's heartbeat in JAX's key-value store (the one the other processes'
    hang watches read) says ``step``; at most a minute."""
    from jax._src import distributed
    client, key = distributed.global_state.client, f"redco/watchdog/{jax.process_index()}"
    deadline = time.monotonic() + 60
    while json.loads(client.blocking_key_value_get(key, 60_000))["step"] != step:
        assert time.monotonic() < deadline, f"no heartbeat for step {step} within 60 s"
        time.sleep(0.01)


class HeldSave(CheckpointFormat):
    """Registered under the name of the format it wraps (so it wins): that format, except that
    its save of ``step_<step>`` is held once the state is written, until the test says go on."""

    def __init__(self, name: str, step: int):
        self.name, self.step = name, step
        self.real = redco.plugins.lookup("checkpoint_formats", name)

    @redco.hookimpl
    def register_checkpoint_formats(self, register):
        register(self.name, self)

    def save(self, path: str, tree) -> None:
        self.real.save(path, tree)
        tmp = os.path.dirname(path)  # <ckpt_dir>/step_N.tmp
        if os.path.basename(tmp) == f"step_{self.step}.tmp":
            hold(tmp, os.path.join(workdir, "go_on_saving"))

    def load(self, path: str, target):
        return self.real.load(path, target)


def hold(tmp: str, go_on: str) -> None:
    """Say the save writing ``tmp`` is in progress, wait (at most 10 minutes) until ``go_on``
    exists, then repeat what the test wrote there and say whether ``tmp`` was still unfinished
    (no checkpoint in its place yet)."""
    name = os.path.basename(tmp).removesuffix(".tmp")
    print(f"save of {name} in progress: its state is in {tmp}; waiting for {go_on}", flush=True)
    deadline = time.monotonic() + 600
    while not os.path.exists(go_on):
        assert time.monotonic() < deadline, f"{go_on} never appeared"
        time.sleep(0.01)
    with open(go_on) as f:
        said = f.read()
    unfinished = os.path.isdir(tmp) and not os.path.exists(tmp.removesuffix(".tmp"))
    print(f"save of {name} goes on after the test {said}; {name}.tmp unfinished: {unfinished}",
          flush=True)


def detected_launcher() -> str:
    config = dict(n_processes=None, host0_address=None, host0_port=None, process_id=None)
    return next(name for name, ln in redco.plugins.registry("launchers").items()
                if ln.detect(config))


def main() -> None:
    multi = not DETECT and int(n_processes) > 1
    launcher = detected_launcher() if DETECT else ("ip" if multi else "local")
    deployer = Deployer(jax_seed=0, n_model_shards=2, n_context_shards=CONTEXT_SHARDS,
                        workdir=workdir,  # verbose: bars in job logs
                        checkpoint_format=CKPT_FORMAT, async_checkpoints=not BLOCKING_CKPTS,
                        n_processes=int(n_processes) if multi else None,
                        host0_address="127.0.0.1" if multi else None,
                        host0_port=int(port) if multi else None,
                        process_id=int(process_id) if multi else None)
    if TERM_DURING_SAVE:
        redco.plugins.pm.register(HeldSave(CKPT_FORMAT, TERM_DURING_SAVE))
    apply_fn, params = lm_model()
    recorder = Recorder()
    trainer = Trainer(deployer, collate_fn, apply_fn, loss_fn, params,
                      optax.sgd(0.1, momentum=0.9),
                      callbacks=[recorder, KillAt()])
    examples = CountedReads(lm_examples(32))
    trainer.fit(examples, GLOBAL_BATCH // deployer.dp_size, n_epochs=N_EPOCHS, save_last_ckpt=True)
    predictor = trainer.get_default_predictor(
        pred_fn=lambda params, batch: apply_fn(params, batch["input_ids"][:, :-1]).argmax(-1))
    preds = predictor.predict(examples[:11], 1, params=trainer.params)
    host_params = {path: np.asarray(jax.device_get(x))  # process_allgather of replicated/sharded
                   for path, x in named_leaves(jax.experimental.multihost_utils.process_allgather(
                       trainer.params, tiled=True))}
    result = {"launcher": launcher, "process_count": jax.process_count(),
              "devices": jax.device_count(), "local_devices": jax.local_device_count(),
              "losses": recorder.losses, "examples_read": examples.reads,
              "preds": [np.asarray(p).tolist() for p in preds],
              "ckpts": sorted(os.listdir(deployer.ckpt_dir))}
    with open(os.path.join(workdir, f"result_{jax.process_index()}.json"), "w") as f:
        json.dump(result, f)
    if deployer.is_main_process:
        np.savez(os.path.join(workdir, "params.npz"), **host_params)


if __name__ == "__main__":
    main()
