"""The step-time hiccup of a step checkpoint, written in the background against written while
training waits, on a model whose training state is over 1 GB.

Three runs of the same ``Trainer.fit``, each in a fresh process and workdir: the zoo's LLaMA
(``--hidden_size`` 768, ``--n_layers`` 6, vocab 32000: about 91M params; fp32 params and
AdamW's two moments, about 1.1 GB of state), ``--steps`` updates of one 32-token row per device,
and

* ``none``: no step checkpoint;
* ``blocking``: one every ``--save_every`` updates, ``Deployer(async_checkpoints=False)``;
* ``async``: the same, written in the background (the default).

Printed per run: the state's size, how long training stood still at a save in mid-run (the
median of its ``checkpoint`` phases, ``on_time_spent``: the whole write when blocking, the host
copy when async), the median step time (``metrics.jsonl``) apart from and beside a write in
flight, and the wall time of the training loop (``goodput.json``); then the hiccup ratio
async / blocking, each the pause plus what the step beside the write lost.

With ``--processes 2`` each run is 2 processes of 4 devices, joined through ``jax.distributed``
on 127.0.0.1 (redco's ``ip`` launcher): the writer threads meet at the coordination service's
barriers, and what training waits for at a save is each process's host copy.

    python bench/async_checkpoint.py [--steps 16 --save_every 4 --format orbax --processes 1]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from provenance import print_provenance  # noqa: E402


def worker(args) -> None:
    """In a fresh process: train, then print one JSON line of what the run measured."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                               f"device_count={8 // args.processes}")
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import redco
    from redco import Deployer, Trainer
    from redco_zoo_lm import collate_fn, loss_fn
    from redco_zoo_models import LlamaConfig, LlamaForCausalLM, split_model
    cfg = LlamaConfig(vocab_size=32000, hidden_size=args.hidden_size, intermediate_size=
                      args.hidden_size * 8 // 3, num_hidden_layers=args.n_layers,
                      num_attention_heads=12, num_key_value_heads=4)
    multi = args.processes > 1
    deployer = Deployer(jax_seed=0, workdir=args.workdir, verbose=False,  # (before any jax call)
                        checkpoint_format=args.format, async_checkpoints=args.side == "async",
                        n_processes=args.processes if multi else None,
                        host0_address="127.0.0.1" if multi else None,
                        host0_port=args.port if multi else None,
                        process_id=args.process_id if multi else None)
    apply_fn, params = split_model(LlamaForCausalLM(cfg, rngs=nnx.Rngs(0)))
    pauses = []

    class Pauses:  # how long each checkpoint phase held training, in order
        @redco.hookimpl
        def on_time_spent(self, phase, seconds):
            if phase == "checkpoint":
                pauses.append(seconds)
    trainer = Trainer(deployer, collate_fn, apply_fn, loss_fn, params, optax.adamw(1e-4),
                      callbacks=[Pauses()])
    rng = np.random.default_rng(0)
    rows = jax.device_count() * args.steps
    examples = [{"token_ids": rng.integers(0, 32000, 33)} for _ in range(rows)]
    trainer.fit(examples, 1, n_epochs=1,
                save_every_n_steps=None if args.side == "none" else args.save_every)
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(trainer.ckpt_tree()))
    if jax.process_index() == 0:
        print(json.dumps({"state_bytes": state_bytes, "pauses": pauses}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(side: str, args) -> dict:
    workdir = tempfile.mkdtemp(prefix=f"async-ckpt-{side}-")
    cmd = [sys.executable, __file__, "--worker", "--side", side, "--workdir", workdir,
           "--steps", str(args.steps), "--save_every", str(args.save_every), "--format",
           args.format, "--hidden_size", str(args.hidden_size), "--n_layers", str(args.n_layers)]
    port = free_port()
    procs = [subprocess.Popen(cmd + ["--processes", str(args.processes), "--process_id", str(i),
                                     "--port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(args.processes)]
    outputs = [p.communicate() for p in procs]
    for p, (_, err) in zip(procs, outputs):
        if p.returncode != 0:
            raise SystemExit(f"{side} failed:\n{err[-3000:]}")
    out = json.loads(outputs[0][0].strip().splitlines()[-1])
    with open(os.path.join(workdir, "goodput.json")) as f:
        (record,) = json.load(f)["runs"]
    mid_run = out["pauses"][:args.steps // args.save_every - 1]  # not the end's save and wait
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if "perf/step_time_s" in line]
    times = {r["step"]: r["perf/step_time_s"] for r in rows}
    saves = [s for s in times if side != "none" and s % args.save_every == 0 and s < args.steps]
    beside = [times[s + 1] for s in saves if s + 1 in times]  # the steps after a save began
    quiet = [t for s, t in times.items() if s - 1 not in saves]
    return {"side": side, "state_gb": out["state_bytes"] / 1e9, "saves": len(saves),
            "pause_s": statistics.median(mid_run) if mid_run else 0.0,
            "step_s": statistics.median(quiet),
            "beside_s": statistics.median(beside) if beside else float("nan"),
            "loop_s": record["data"] + record["steps"] + record["checkpoint"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--save_every", type=int, default=4)
    parser.add_argument("--format", default="orbax")
    parser.add_argument("--hidden_size", type=int, default=768)
    parser.add_argument("--n_layers", type=int, default=6)
    parser.add_argument("--processes", type=int, default=1, help="1, or 2 (4 devices each)")
    parser.add_argument("--process_id", type=int, default=0)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--side", default="async")
    parser.add_argument("--workdir")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    print_provenance()
    print(f"processes: {args.processes}, {8 // args.processes} devices each\n")
    results = {side: run(side, args) for side in ("none", "blocking", "async")}
    print("| run | state, GB | saves | training stopped per save, s | median step, s | "
          "median step beside a write, s | loop wall, s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results.values():
        print(f"| {r['side']} | {r['state_gb']:.2f} | {r['saves']} | {r['pause_s']:.2f} | "
              f"{r['step_s']:.2f} | {r['beside_s']:.2f} | {r['loop_s']:.1f} |")

    def hiccup(r) -> float:  # per save: the pause, and what the step beside the write lost
        return r["pause_s"] + max(0.0, r["beside_s"] - r["step_s"])
    blocking, background = results["blocking"], results["async"]
    print(f"\nhiccup per save (pause + the slowdown of the step beside the write): blocking "
          f"{hiccup(blocking):.2f} s, async {hiccup(background):.2f} s, ratio async / blocking "
          f"{hiccup(background) / hiccup(blocking):.2f}")


if __name__ == "__main__":
    main()
