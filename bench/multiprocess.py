"""Steps/s of the same training run as 1, 2 and 4 processes on this machine (8 CPU devices in
all, the same global batch), so the cost of crossing process boundaries is visible.

Each process count is one launch of N copies of this script (``--worker``), joined through
``jax.distributed`` on 127.0.0.1 by redco's ``ip`` launcher. Every worker trains the zoo's
LLaMA-style model (``n_model_shards=2``, global batch 32 x 128 tokens): one warm-up ``fit``
(compilation), then a timed ``fit`` over ``--steps`` global batches. Process 0 reports.

Run:  python bench/multiprocess.py [--steps 20 --processes 1,2,4]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

TOTAL_DEVICES = 8


def worker(args) -> None:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    import jax
    import optax
    from flax import nnx

    from redco import Deployer, Trainer
    from redco_zoo_lm import collate_fn, loss_fn
    from redco_zoo_models import LlamaConfig, LlamaForCausalLM, split_model
    sys.path.insert(0, os.path.dirname(__file__))
    from trainer_vs_jit import byte_sequences

    multi = args.n_processes > 1
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=args.workdir, verbose=False,
                        loggers=(), n_processes=args.n_processes if multi else None,
                        host0_address="127.0.0.1" if multi else None,
                        host0_port=args.port if multi else None,
                        process_id=args.process_id if multi else None)
    apply_fn, params = split_model(LlamaForCausalLM(LlamaConfig(), rngs=nnx.Rngs(0)))
    trainer = Trainer(deployer, collate_fn, apply_fn, loss_fn, params, optax.adamw(1e-3))
    per_device = 32 // deployer.dp_size
    examples = byte_sequences(128, 32 * args.steps)
    timings = []
    for _ in range(2):  # warm-up, then timed
        trainer.set_train_state(step=0)  # so fit runs its epoch again
        start = time.perf_counter()
        trainer.fit(examples, per_device, n_epochs=1, resume=False)
        timings.append(time.perf_counter() - start)
    if deployer.is_main_process:
        print(json.dumps({"steps_per_s": args.steps / timings[1], "processes": jax.process_count(),
                          "devices": jax.device_count()}), flush=True)


def launch(n_processes: int, steps: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="redco-mp-bench-")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen(
        [sys.executable, __file__, "--worker", "--process_id", str(i), "--n_processes",
         str(n_processes), "--port", str(port), "--devices", str(TOTAL_DEVICES // n_processes),
         "--steps", str(steps), "--workdir", workdir], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True) for i in range(n_processes)]
    outputs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"{n_processes} processes: a worker failed (rerun with --worker to see)")
    return json.loads(outputs[0].strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--processes", default="1,2,4")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("process_id", "n_processes", "port", "devices"):
        parser.add_argument(f"--{name}", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    print(f"{TOTAL_DEVICES} CPU devices in all on {os.cpu_count()} cores, mesh dp4 x mp2, global "
          f"batch 32 x 128 tokens, {args.steps} timed steps after a warm-up fit")
    print(f"{'processes':>9} {'devices each':>13} {'steps/s':>9} {'vs 1 process':>13}")
    base = None
    for n in map(int, args.processes.split(",")):
        result = launch(n, args.steps)
        base = base or result["steps_per_s"]
        print(f"{n:>9} {TOTAL_DEVICES // n:>13} {result['steps_per_s']:>9.2f} "
              f"{result['steps_per_s'] / base:>13.2f}", flush=True)


if __name__ == "__main__":
    from provenance import print_provenance
    print_provenance()
    main()
