"""Redco against EasyDeL (PyPI, pinned), the same LLaMA shape trained on 8 simulated CPU devices.

Both train a LLaMA of hidden 256, intermediate 768, 4 layers, 4 query and 2 key/value heads,
vocab 32,000 (19.5M params, untied head), sequence 256, global batch 16, float32 params and
compute, AdamW, each with its own compiled train step:

  redco    the zoo's ``LlamaForCausalLM`` (its layers stacked and scanned, the default) in a
           ``Trainer``; ``trainer.steps.train`` (the step
           ``fit`` runs) over batches placed by ``Deployer.make_batch``; its loss the zoo's
           ``labels=`` path (``redco_zoo_models.chunked_loss``).
  easydel  ``easydel.LlamaForCausalLM``; ``easydel.trainers.trainer._fn.training_step`` compiled
           as EasyDeL's ``Trainer.configure_functions`` compiles it (``ejit``, the state's
           shardings, the state donated), its state sharded by the model's partition rules.

The two cannot share an environment (EasyDeL 0.3.0 pins jax 0.9.2; this repository jax 0.10.2),
so this script is a driver that starts one worker per framework (``--easydel_python``: a venv
with ``easydel==0.3.0``, ``tox -e bench-easydel`` makes one) for each layout, dp 8 and
dp 4 x mp 2 (EasyDeL's ``sharding_axis_dims`` ``(dp, fsdp, ep, tp, sp)`` = ``(8,1,1,1,1)`` and
``(4,1,1,2,1)``; Redco's ``n_model_shards`` 1 and 2). Both workers compile, then the driver
alternates them, ``--rounds`` rounds of ``--steps`` steps each (the first round's order
reversed every other round), one worker idle while the other runs: background load hits both
alike. Per round each worker reports wall seconds, tokens/s and the CPU seconds its process used
(``os.times``: user + system over all threads) over the wall seconds: how many cores it kept
busy. On a shared box the cores a worker gets swing with the others' load; the ratio of tokens
per CPU-second (tokens/s over cores) is the steadier figure.

Same start: the Redco worker writes its initial params (``redco_zoo_models.hf_init``: as
transformers draws a LLaMA) to an ``.npz`` by path, each layer's own (``layer_stacks.unstack``);
the EasyDeL worker loads them into its
state, and both report the first step's loss on the same first batch (random tokens; the loss
counts the 255 next-token predictions of each 256-token row, EasyDeL's convention).

``--hlo_dir``: each worker dumps its optimized HLO (``--xla_dump_to``); the driver counts the
train step module's fusions and collectives.

Run:  tox -e bench-easydel    or
      python bench/vs_easydel.py --easydel_python .venv-easydel/bin/python [--rounds 4 --steps 2]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV, SEQ, BATCH = 32000, 256, 768, 4, 4, 2, 256, 16
LAYOUTS = {"dp8": 1, "dp4xmp2": 2}  # layout -> model shards
TAG = "VS_EASYDEL "


def batches(n: int, seed: int = 0):
    """``n`` global batches of random token ids (BATCH, SEQ), the same on both sides."""
    import numpy as np
    rs = np.random.RandomState(seed)
    return [rs.randint(0, VOCAB, (BATCH, SEQ)).astype(np.int32) for _ in range(n)]


def say(kind: str, **fields) -> None:
    print(TAG + json.dumps({"kind": kind, **fields}), flush=True)


def serve(step, first_loss: float, meta: dict, steps: int) -> None:
    """Report ready, then on each ``run`` line time ``steps`` calls of ``step()``."""
    say("ready", first_loss=first_loss, **meta)
    for line in sys.stdin:
        if line.strip() != "run":
            return
        t0, c0 = time.perf_counter(), os.times()
        loss = step(steps)
        wall, c1 = time.perf_counter() - t0, os.times()
        cpu = (c1.user - c0.user) + (c1.system - c0.system)
        say("round", wall=wall, tokens_per_s=steps * BATCH * SEQ / wall, cores=cpu / wall,
            loss=loss)


def redco_worker(args) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from redco import Deployer, Trainer
    from redco.layer_stacks import unstack
    from redco.tree_paths import named_leaves
    from redco_zoo_models import LlamaConfig, LlamaForCausalLM, split_model

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         num_key_value_heads=KV, max_position_embeddings=SEQ)
    apply_fn, params = split_model(LlamaForCausalLM(config, rngs=nnx.Rngs(0)))
    np.savez(args.params, **unstack({p: np.asarray(x) for p, x in named_leaves(params)}))
    say("params", n=int(sum(x.size for _, x in named_leaves(params))))

    def loss_fn(rng, state, params, batch, is_training):
        ids = batch["input_ids"]
        labels = jnp.roll(ids, -1, axis=1)  # the last position predicts nothing (masked)
        mask = jnp.ones_like(ids, bool).at[:, -1].set(False)
        return state.apply_fn(params, ids, labels=labels, label_mask=mask)

    deployer = Deployer(jax_seed=0, n_model_shards=LAYOUTS[args.layout],
                        workdir=tempfile.mkdtemp(prefix="vs-easydel-"), verbose=False)
    trainer = Trainer(deployer=deployer, collate_fn=lambda rows: {"input_ids": np.stack(rows)},
                      apply_fn=apply_fn, loss_fn=loss_fn, params=params,
                      optimizer=optax.adamw(1e-4), compute_dtype=jnp.float32)
    per_device = BATCH // deployer.get_global_batch_size(1)
    trainer.eval_loss([b for b in batches(1)[0]], per_device)  # decides the layout
    data = [deployer.make_batch(list(b), trainer.collate_fn, n_micro=1) for b in batches(2)]
    state, metrics = trainer.steps.train(trainer.state, data[0])
    first = float(metrics["loss"])
    holder = {"state": state, "i": 1}

    def step(n: int) -> float:
        for _ in range(n):
            holder["state"], m = trainer.steps.train(holder["state"], data[holder["i"] % 2])
            holder["i"] += 1
        jax.block_until_ready(holder["state"])
        return float(m["loss"])
    serve(step, first, {"jax": jax.__version__, "mesh": dict(deployer.mesh.shape)}, args.steps)


def easydel_worker(args) -> None:
    import easydel as ed
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from easydel.infra.loss_utils import LossConfig
    from easydel.trainers.trainer._fn import training_step
    from easydel.utils.compiling_utils import ejit
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    config = ed.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                            num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                            num_key_value_heads=KV, max_position_embeddings=SEQ,
                            rms_norm_eps=1e-6, sharding_axis_dims=(
                                8 // LAYOUTS[args.layout], 1, 1, LAYOUTS[args.layout], 1))
    model = ed.LlamaForCausalLM(config=config, dtype=jnp.float32, param_dtype=jnp.float32,
                                precision=None, rngs=nnx.Rngs(0))
    load_params(model, np.load(args.params))
    with model.mesh:
        state = model.to_state().init_tx(optax.adamw(1e-4))
        state = state.shard_state(partition_rules=model._get_partition_rules(None),
                                  mesh=model.mesh)
    replicated = NamedSharding(spec=P(), mesh=model.mesh)
    train = ejit(training_step, static_argnums=(2, 3, 4, 5, 6),
                 in_shardings=(state.shardings, replicated),
                 out_shardings=(state.shardings, replicated), donate_argnums=(0,))
    static = (LossConfig(), None, P(("dp", "fsdp"), "sp"), 1, None)
    data = [{"input_ids": b, "attention_mask": np.ones_like(b), "labels": b} for b in batches(2)]
    model.mesh.__enter__()  # EasyDeL's trainer runs its steps inside the mesh
    state, metrics = train(state, data[0], *static)
    first = float(metrics.loss)
    holder = {"state": state, "i": 1}

    def step(n: int) -> float:
        for _ in range(n):
            holder["state"], m = train(holder["state"], data[holder["i"] % 2], *static)
            holder["i"] += 1
        jax.block_until_ready(holder["state"])
        return float(m.loss)
    serve(step, first, {"jax": jax.__version__, "easydel": ed.__version__,
                        "attn_mechanism": str(config.attn_mechanism),
                        "gradient_checkpointing": str(config.gradient_checkpointing),
                        "mesh": dict(model.mesh.shape)}, args.steps)


def load_params(model, saved) -> None:
    """``saved`` (Redco's params by path) into EasyDeL's model, matched by path and shape."""
    import jax.numpy as jnp
    from flax import nnx
    leaves = [(path, var) for path, var in nnx.iter_graph(model) if isinstance(var, nnx.Param)]
    for path, var in leaves:
        name = "/".join(str(p) for p in path)
        ours = name.replace("norm/kernel", "norm/weight")
        if ours not in saved or saved[ours].shape != var.shape:
            raise KeyError(f"EasyDeL param {name} {var.shape} has no Redco twin")
        var.value = jnp.asarray(saved[ours])
    if len(leaves) != len(saved.files):
        raise KeyError(f"{len(saved.files)} Redco params, {len(leaves)} EasyDeL params")


class Worker:
    """One framework's worker process for one layout, driven over its stdin/stdout."""

    def __init__(self, side: str, python: str, args, layout: str, log):
        flags = "--xla_force_host_platform_device_count=8"
        if args.hlo_dir:
            flags += f" --xla_dump_to={args.hlo_dir}/{side}-{layout} --xla_dump_hlo_as_text"
        # -P: not bench/ first on the path (its multiprocess.py would shadow the package)
        env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
        self.side = side
        self.proc = subprocess.Popen(
            [python, "-P", os.path.abspath(__file__), "--worker", side, "--layout", layout,
             "--steps", str(args.steps), "--params", args.params], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=log, text=True, env=env)

    def expect(self, kind: str) -> dict:
        for line in self.proc.stdout:
            if line.startswith(TAG):
                message = json.loads(line[len(TAG):])
                if message["kind"] != kind:
                    raise RuntimeError(f"{self.side}: expected {kind}, got {message}")
                return message
        raise RuntimeError(f"{self.side} worker exited ({self.proc.wait()}); see its log")

    def round(self) -> dict:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return self.expect("round")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def run_layout(args, layout: str, log) -> dict:
    """Both workers ready, then ``args.rounds`` alternating rounds."""
    t0 = time.perf_counter()
    redco = Worker("redco", sys.executable, args, layout, log)
    n_params = redco.expect("params")["n"]
    easydel = Worker("easydel", args.easydel_python, args, layout, log)
    ready = {"redco": redco.expect("ready"), "easydel": easydel.expect("ready")}
    setup = time.perf_counter() - t0
    rounds = {"redco": [], "easydel": []}
    for r in range(args.rounds):
        for w in ((redco, easydel) if r % 2 == 0 else (easydel, redco)):
            rounds[w.side].append(w.round())
    redco.close()
    easydel.close()
    return {"ready": ready, "rounds": rounds, "n_params": n_params, "setup_s": setup}


def hlo_counts(directory: str) -> dict:
    """Fusions and collectives of the largest optimized module (the train step) in a dump."""
    import re
    files = [os.path.join(directory, f) for f in os.listdir(directory)
             if f.endswith("after_optimizations.txt")]
    text = open(max(files, key=os.path.getsize)).read()
    ops = ("fusion", "all-reduce", "all-gather", "reduce-scatter", "collective-permute",
           "all-to-all", "custom-call", "while", "dot", "copy", "transpose")
    counts = {op: len(re.findall(rf" {op}(-start)?\(", text)) for op in ops}
    kinds = {kind: len(re.findall(rf"kind=k{kind}\b", text)) for kind in ("Loop", "Custom")}
    moved = 0  # bytes out of every collective: each f32/s32 array of its (tuple) result
    for result in re.findall(r"= (.*?) (?:all-reduce|all-gather|reduce-scatter|all-to-all|"
                             r"collective-permute)(?:-start)?\(", text):
        for dims in re.findall(r"[fs]32\[([\d,]*)\]", result):
            moved += 4 * math.prod(int(d) for d in dims.split(",") if d)
    return {**counts, "fusion kinds": kinds, "collective MB": round(moved / 2 ** 20, 1)}


def report(layout: str, result: dict, hlo: dict | None) -> None:
    rounds, ready = result["rounds"], result["ready"]
    print(f"\n### {layout}: {result['n_params']:,} params, setup (import + init + compile of "
          f"both) {result['setup_s']:.0f} s")
    for side in ("redco", "easydel"):
        info = {k: v for k, v in ready[side].items() if k != "kind"}
        print(f"  {side}: {info}")
    print(f"  {'round':<7}{'redco tok/s':>12}{'cores':>7}{'easydel tok/s':>15}{'cores':>7}"
          f"{'ratio':>8}{'per CPU-s':>11}")
    ratios, per_cpu = [], []
    for i, (a, b) in enumerate(zip(rounds["redco"], rounds["easydel"])):
        ratios.append(a["tokens_per_s"] / b["tokens_per_s"])
        per_cpu.append(ratios[-1] * b["cores"] / a["cores"])  # tokens per CPU-second's ratio
        print(f"  {i:<7}{a['tokens_per_s']:>12.0f}{a['cores']:>7.2f}{b['tokens_per_s']:>15.0f}"
              f"{b['cores']:>7.2f}{ratios[-1]:>8.3f}{per_cpu[-1]:>11.3f}")
    for name, values in (("tokens/s", ratios), ("tokens per CPU-second", per_cpu)):
        print(f"  redco/easydel, {name}: median {statistics.median(values):.3f}, "
              f"min {min(values):.3f}, max {max(values):.3f}")
    if hlo:
        for side, counts in hlo.items():
            print(f"  {side} train step HLO: {counts}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--easydel_python", default=".venv-easydel/bin/python")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2, help="steps per round")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--hlo_dir", help="dump both steps' optimized HLO here and count ops")
    parser.add_argument("--worker", choices=["redco", "easydel"], help=argparse.SUPPRESS)
    parser.add_argument("--layout", choices=list(LAYOUTS), help=argparse.SUPPRESS)
    parser.add_argument("--params", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return (redco_worker if args.worker == "redco" else easydel_worker)(args)
    if not os.path.isfile(args.easydel_python):
        parser.error(f"--easydel_python {args.easydel_python} does not exist: make a venv with "
                     "easydel==0.3.0 (tox -e bench-easydel does).")
    from provenance import print_provenance  # (bench/, on the path of the driver only)
    print_provenance()
    print(f"load average before: {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as tmp, open(os.path.join(tmp, "log"), "w+") as log:
        args.params = os.path.join(tmp, "params.npz")
        for layout in args.layouts:
            try:
                result = run_layout(args, layout, log)
            except RuntimeError:
                log.seek(0)
                print(log.read()[-4000:], file=sys.stderr)
                raise
            hlo = {side: hlo_counts(f"{args.hlo_dir}/{side}-{layout}")
                   for side in ("redco", "easydel")} if args.hlo_dir else None
            report(layout, result, hlo)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
