"""This Redco against the original Redco 0.4.23 (PyPI), same model, mesh, batch and optimizer.

The two Redcos cannot share a process or an environment (both are the ``redco`` package), so
this script is a driver that runs itself as a worker subprocess once per side:

  old side   ``--old_python`` (a venv with ``redco==0.4.23``): original Deployer + Trainer.fit
  new side   this interpreter (this repository's redco):     Deployer + Trainer.fit

The model is a LLaMA-style decoder written in Flax linen below (``LinenLlama``: RoPE, GQA,
RMSNorm, SwiGLU), with exactly the shapes, parameter names and FLOPs of the zoo's NNX
``redco_zoo_models.LlamaForCausalLM``. The linen model runs on BOTH sides, so the headline ratio
is apples-to-apples (redco 0.4.23 needs a dict of linen params). The new side additionally
trains the zoo's NNX model itself, as a second row.

Each worker: one warm-up ``fit`` (compilation excluded), then ``--repeats`` timed
``fit(n_epochs=1)`` over exactly ``--steps`` global batches; median tokens/s is reported
(tokens = global batch x seq_len per step). ``--rounds`` > 1 runs old/new alternately again.

Setup of the old side (see BENCHMARKS.md):
  python -m venv /tmp/redco0423-venv
  /tmp/redco0423-venv/bin/pip install redco==0.4.23 tqdm jax==0.10.2 flax==0.12.8 \
      optax==0.2.8 orbax-checkpoint

Run:  python bench/vs_redco_0423.py --old_python /tmp/redco0423-venv/bin/python
"""
from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

RESULT = "BENCH_RESULT "


# ---- the model, in Flax linen, for both sides ----------------------------------------------
def make_linen_model(hidden_size: int, n_layers: int, vocab_size: int = 256,
                     n_heads: int = 4, n_kv_heads: int = 2, eps: float = 1e-6,
                     rope_theta: float = 10000.0):
    """LLaMA-style decoder, parameter for parameter the zoo's ``LlamaForCausalLM``."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    head_dim, inter = hidden_size // n_heads, hidden_size * 11 // 4

    def dense(features, name):
        return nn.Dense(features, use_bias=False, name=name)

    class RMSNorm(nn.Module):
        @nn.compact
        def __call__(self, x):
            weight = self.param("weight", nn.initializers.ones, (x.shape[-1],))
            x32 = x.astype(jnp.float32)
            x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 ** 2, axis=-1, keepdims=True) + eps)
            return (x32 * weight).astype(x.dtype)

    def apply_rope(x, positions):
        half = x.shape[-1] // 2
        freqs = rope_theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
        angles = positions[..., None].astype(jnp.float32) * freqs
        cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
        x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)

    class Attention(nn.Module):
        @nn.compact
        def __call__(self, x, positions):
            b, t, _ = x.shape
            q = dense(n_heads * head_dim, "q_proj")(x).reshape(b, t, n_heads, head_dim)
            k = dense(n_kv_heads * head_dim, "k_proj")(x).reshape(b, t, n_kv_heads, head_dim)
            v = dense(n_kv_heads * head_dim, "v_proj")(x).reshape(b, t, n_kv_heads, head_dim)
            q, k = apply_rope(q, positions), apply_rope(k, positions)
            out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
            return dense(hidden_size, "o_proj")(out.reshape(b, t, -1))

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            gate, up = dense(inter, "gate_proj")(x), dense(inter, "up_proj")(x)
            return dense(hidden_size, "down_proj")(jax.nn.silu(gate) * up)

    class DecoderLayer(nn.Module):
        @nn.compact
        def __call__(self, x, positions):
            x = x + Attention(name="self_attn")(RMSNorm(name="input_layernorm")(x), positions)
            return x + MLP(name="mlp")(RMSNorm(name="post_attention_layernorm")(x))

    class LinenLlama(nn.Module):
        @nn.compact
        def __call__(self, input_ids):
            positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1]), input_ids.shape)
            x = nn.Embed(vocab_size, hidden_size, name="embed_tokens")(input_ids)
            for i in range(n_layers):
                x = DecoderLayer(name=f"layers_{i}")(x, positions)
            x = RMSNorm(name="norm")(x)
            return dense(vocab_size, "lm_head")(x)

    return LinenLlama()


# ---- the three functions, identical on both sides -----------------------------------------
def collate_fn(examples):
    import numpy as np
    return {"input_ids": np.stack([np.asarray(e["token_ids"], np.int32) for e in examples])}


def loss_fn(rng, state, params, batch, is_training):
    import jax.numpy as jnp
    import optax
    ids = batch["input_ids"]
    logits = state.apply_fn(params, ids[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()


def byte_sequences(seq_len: int, n: int) -> list[dict]:
    from pydoc_data.topics import topics

    import numpy as np
    data = np.frombuffer("\n".join(topics.values()).encode(), np.uint8).astype(np.int32)
    rows = data[:len(data) // (seq_len + 1) * (seq_len + 1)].reshape(-1, seq_len + 1)
    return [{"token_ids": rows[i % len(rows)]} for i in range(n)]


# ---- a worker: one side, one model -----------------------------------------------------------
def worker(args) -> None:
    import flax
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import redco

    results = {"side": args.side, "model": args.model, "redco": redco.__version__,
               "jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
               "devices": jax.device_count()}
    workdir = tempfile.mkdtemp(prefix=f"redco-bench-{args.side}-")
    optimizer = optax.adamw(1e-3, weight_decay=0.01)

    if args.model == "linen":
        model = make_linen_model(args.hidden_size, args.n_layers)
        params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, args.seq_len), jnp.int32))
        params = jax.tree.map(np.asarray, flax.core.unfreeze(params["params"]))

        def apply_fn(params, ids):
            return model.apply({"params": params}, ids)
    else:
        from flax import nnx

        from redco_zoo_models import LlamaConfig, LlamaForCausalLM, split_model
        config = LlamaConfig(hidden_size=args.hidden_size, num_hidden_layers=args.n_layers,
                             intermediate_size=args.hidden_size * 11 // 4)
        apply_fn, params = split_model(LlamaForCausalLM(config, rngs=nnx.Rngs(0)))
    results["params"] = int(sum(np.size(x) for x in jax.tree.leaves(params)))

    if args.side == "old":
        deployer = redco.Deployer(jax_seed=0, n_model_shards=args.n_model_shards,
                                  workdir=None, verbose=False)
        global_batch = deployer.get_local_global_micro_batch_size(
            args.per_device_batch_size)[1]
        trainer = redco.Trainer(deployer=deployer, collate_fn=collate_fn, apply_fn=apply_fn,
                                loss_fn=loss_fn, params=params, optimizer=optimizer,
                                params_sharding_rules=deployer.get_sharding_rules(params))
        mesh = deployer.mesh

        def prepare():
            pass
    else:
        deployer = redco.Deployer(jax_seed=0, n_model_shards=args.n_model_shards,
                                  workdir=workdir, verbose=False)
        global_batch = deployer.get_global_batch_size(args.per_device_batch_size)
        trainer = redco.Trainer(
            deployer=deployer, collate_fn=collate_fn, apply_fn=apply_fn, loss_fn=loss_fn,
            params=params, optimizer=optimizer,
            params_sharding_rules=deployer.get_sharding_rules(params))
        mesh = deployer.mesh

        def prepare():  # fit runs epochs from the state's step: rewind so it trains again
            trainer.set_train_state(step=0)

    examples = byte_sequences(args.seq_len, args.steps * global_batch)
    fit_kwargs = {} if args.side == "old" else {"resume": False}

    def run() -> float:
        prepare()
        t0 = time.perf_counter()
        trainer.fit(examples, per_device_batch_size=args.per_device_batch_size, n_epochs=1,
                    **fit_kwargs)
        jax.block_until_ready(trainer.state.params)
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    run()
    results["warmup_s"] = time.perf_counter() - t0
    if args.collectives:
        results["collectives"] = count_collectives(args, trainer, deployer,
                                                   examples[:global_batch])
    times = [run() for _ in range(args.repeats)]
    tokens = args.steps * global_batch * args.seq_len
    results.update(mesh=dict(mesh.shape), global_batch=global_batch, seq_len=args.seq_len,
                   steps=args.steps, tokens_per_s=[tokens / t for t in times],
                   steps_per_s=[args.steps / t for t in times])
    print(RESULT + json.dumps(results), flush=True)


def count_collectives(args, trainer, deployer, examples) -> dict:
    """How many of each collective the compiled train step holds (as XLA's HLO text)."""
    import re

    import jax
    if args.side == "old":
        dp = deployer.mesh.shape["dp"]
        batch = jax.tree.map(lambda x: x.reshape((dp, -1) + x.shape[1:]), collate_fn(examples))
        with deployer.mesh:
            hlo = trainer._p_train_step.lower(jax.random.PRNGKey(0), trainer.state,
                                              batch).compile().as_text()
    else:
        batch = deployer.make_batch(examples, collate_fn, n_micro=1)
        hlo = trainer.steps.train.lower(trainer.state, batch).compile().as_text()
    ops = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
    return {op: len(re.findall(rf"= [^=]*? {op}(-start)?\(", hlo)) for op in ops}


# ---- the driver ------------------------------------------------------------------------------
def run_worker(python: str, side: str, model: str, args) -> dict:
    cmd = [python, os.path.abspath(__file__), "--side", side, "--model", model]
    if args.collectives:
        cmd.append("--collectives")
    for name in ("steps", "repeats", "n_model_shards", "per_device_batch_size", "seq_len",
                 "hidden_size", "n_layers"):
        cmd += [f"--{name}", str(getattr(args, name))]
    print(f"[{side}/{model}] {' '.join(cmd)}", file=sys.stderr, flush=True)
    # The old side runs in its own environment only: a PYTHONPATH set for this one would put the
    # new redco ahead of 0.4.23 there.
    env = {k: v for k, v in os.environ.items() if not (side == "old" and k == "PYTHONPATH")}
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env,
                          stderr=subprocess.PIPE if args.quiet else None)
    if proc.returncode:
        raise SystemExit(f"{side} worker failed (exit {proc.returncode}):\n{proc.stdout}"
                         f"{proc.stderr or ''}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith(RESULT))
    return json.loads(line[len(RESULT):])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old_python", default=os.environ.get(
        "REDCO0423_PYTHON", "/tmp/redco0423-venv/bin/python"),
        help="python of the env holding redco==0.4.23 (or $REDCO0423_PYTHON)")
    parser.add_argument("--steps", type=int, default=20, help="steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the old/new workers this many times, alternating")
    parser.add_argument("--n_model_shards", type=int, default=2)
    parser.add_argument("--per_device_batch_size", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--hidden_size", type=int, default=128)
    parser.add_argument("--n_layers", type=int, default=2)
    parser.add_argument("--no_nnx", action="store_true", help="skip the zoo NNX model row")
    parser.add_argument("--quiet", action="store_true",
                        help="hide the workers' stderr (progress bars) unless they fail")
    parser.add_argument("--collectives", action="store_true",
                        help="also count the collectives in each side's compiled train step")
    parser.add_argument("--side", choices=["old", "new"], help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=["linen", "nnx"], default="linen",
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side:
        worker(args)
        return

    jobs = [("old", "linen"), ("new", "linen")]
    if not args.no_nnx:
        jobs.append(("new", "nnx"))
    runs: dict[tuple, list] = {}
    for r in range(args.rounds):
        for job in (jobs if r % 2 == 0 else jobs[::-1]):
            side, model = job
            python = args.old_python if side == "old" else sys.executable
            runs.setdefault(job, []).append(run_worker(python, side, model, args))

    first = runs[("old", "linen")][0]
    print()
    print(f"mesh {first['mesh']} on {first['devices']} devices ({os.cpu_count()} CPU cores) | "
          f"global batch {first['global_batch']} x {first['seq_len']} tokens | "
          f"{args.rounds} round(s) x {args.repeats} repeats x {args.steps} steps per side")
    header = (f"{'side':<34}{'params':>10}{'tokens/s (median)':>19}{'min':>9}{'max':>9}"
              f"{'steps/s':>9}")
    print(header)
    print("-" * len(header))
    median = {}
    for (side, model), results in runs.items():
        tps = [x for res in results for x in res["tokens_per_s"]]
        sps = [x for res in results for x in res["steps_per_s"]]
        res = results[0]
        label = f"redco {res['redco']} {'linen' if model == 'linen' else 'zoo NNX'}"
        median[side, model] = statistics.median(tps)
        print(f"{label:<34}{res['params']:>10,}{median[side, model]:>19,.0f}"
              f"{min(tps):>9,.0f}{max(tps):>9,.0f}{statistics.median(sps):>9.2f}")
    print()
    base = median["old", "linen"]
    print(f"ratio new/old, same linen model:    {median['new', 'linen'] / base:.3f}")
    if ("new", "nnx") in median:
        print(f"ratio new (zoo NNX) / old (linen):  {median['new', 'nnx'] / base:.3f}")
    for (side, model), results in runs.items():
        res = results[0]
        print(f"  {side}/{model}: redco {res['redco']}, jax {res['jax']}, flax {res['flax']}, "
              f"optax {res['optax']}, warm-up {res['warmup_s']:.1f}s")
        if "collectives" in res:
            print(f"    collectives in the compiled train step: {res['collectives']}")


if __name__ == "__main__":
    from provenance import print_provenance
    print_provenance()
    main()
