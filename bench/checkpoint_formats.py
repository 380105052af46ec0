"""Save time, restore time and size on disk of one training checkpoint in each built-in format
(``orbax``, ``safetensors``, ``msgpack``), side by side.

The checkpoint is what ``Trainer.save_step_ckpt`` writes: the params of the zoo's LLaMA-style
model (106M at the defaults), their AdamW state and the rng, sharded over a dp4 x mp2 mesh of 8
devices. The AdamW moments are random numbers, as after training (orbax compresses, and
all-zero moments would flatter it). Timed, each ``--repeats`` times (median reported), after an
untimed save and restore of the rng alone (each format's one-time setup):

* save: ``trainer.save_step_ckpt(0)`` into an empty checkpoint directory;
* restore: ``deployer.load_ckpt(path, trainer.ckpt_tree())`` until every array is ready, onto
  the same layout, and onto another (a dp2 x mp4 trainer's target).

Both include what redco adds around the format: the sha256 of every file (computed at save,
checked at load; one pass is also timed alone), fsyncs, meta.json. Every restore is compared
bitwise with what was saved, and its shardings with the target's, outside the timed region.
Restores read files just written, so from the page cache.

Run:  python bench/checkpoint_formats.py [--hidden 768 --layers 8 --repeats 3 --workdir DIR]
      (tiny and quick: --hidden 64 --layers 2 --vocab 256 --intermediate 128 --repeats 1)
"""
from __future__ import annotations

import argparse
import gc
import os
import resource
import shutil
import statistics
import tempfile
import time
from functools import partial

# 8 simulated CPU devices (dp4 x mp2 and dp2 x mp4 layouts), set before jax is imported.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from redco import Deployer, Trainer, checkpointing  # noqa: E402
from redco_zoo_lm import collate_fn, loss_fn  # noqa: E402
from redco_zoo_models import LlamaConfig, LlamaForCausalLM, split_model  # noqa: E402


def randomize(tree, seed):
    """Every float leaf of ``tree`` replaced by random numbers of its shape (jitted by caller)."""
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    return jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape, x.dtype)
                                        if np.issubdtype(x.dtype, np.floating) else x
                                        for k, x in zip(keys, leaves)])


def make_trainer(workdir, fmt, n_model_shards, params, apply_fn) -> Trainer:
    deployer = Deployer(jax_seed=0, n_model_shards=n_model_shards, workdir=workdir, verbose=False,
                        checkpoint_format=fmt, loggers=())
    trainer = Trainer(deployer, collate_fn, apply_fn, loss_fn, params, optax.adamw(1e-4))
    # One evaluation batch decides the layout and places the state (as fit's first batch would).
    one_row = {"token_ids": np.zeros(65, np.int32)}
    trainer.eval_loss([one_row] * deployer.get_global_batch_size(1), 1)
    opt_state = jax.jit(partial(randomize, seed=n_model_shards),  # other values per layout
                        out_shardings=trainer.state_shardings.opt_state)(trainer.state.opt_state)
    trainer.state = jax.block_until_ready(trainer.state.replace(opt_state=opt_state))
    return trainer


def timed(fn):
    start = time.perf_counter()
    result = jax.block_until_ready(fn())
    return time.perf_counter() - start, result


def check_equal(restored, saved, target) -> None:
    for r, s, t in zip(jax.tree.leaves(restored), jax.tree.leaves(saved), jax.tree.leaves(target)):
        assert r.sharding.is_equivalent_to(t.sharding, r.ndim), (r.sharding, t.sharding)
        np.testing.assert_array_equal(np.asarray(r), np.asarray(s))


def disk_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(path) for f in names)


def bench_format(fmt, root, params, apply_fn, other_target, repeats) -> dict:
    trainer = make_trainer(os.path.join(root, fmt), fmt, 2, params, apply_fn)
    saved = trainer.ckpt_tree()
    warmup = trainer.deployer.save_ckpt("warmup", {"rng": saved["rng"]}, {})  # one-time setup
    jax.block_until_ready(trainer.deployer.load_ckpt(warmup, {"rng": saved["rng"]}))
    runs = {"save": [], "restore": [], "restore other": [], "sha256": []}
    for _ in range(repeats):
        shutil.rmtree(trainer.deployer.ckpt_dir, ignore_errors=True)  # the last repeat's
        seconds, path = timed(lambda: trainer.save_step_ckpt(0))
        runs["save"].append(seconds)
        for key, target in (("restore", saved), ("restore other", other_target)):
            seconds, (tree, _) = timed(lambda: trainer.deployer.load_ckpt(path, target))
            runs[key].append(seconds)
            check_equal(tree, saved, target)
            del tree
        meta = checkpointing.read_meta(path)
        runs["sha256"].append(timed(lambda: checkpointing.verify_files(meta))[0])
    result = {key: statistics.median(values) for key, values in runs.items()}
    result["MB"] = disk_bytes(path) / 1e6
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--formats", default="orbax,safetensors,msgpack")
    parser.add_argument("--workdir", help="the checkpoints go in a temporary directory made (and "
                        "removed) in it; default: the system's temporary directory")
    args = parser.parse_args(argv)

    heads = max(1, args.hidden // 64)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=heads)
    apply_fn, params = split_model(LlamaForCausalLM(cfg, rngs=nnx.Rngs(0)))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    with tempfile.TemporaryDirectory(prefix="redco-ckpt-bench-", dir=args.workdir) as root:
        other = make_trainer(os.path.join(root, "other"), "orbax", 4, params, apply_fn)
        other_target = jax.tree.map(  # its layout only, so that its arrays can be freed
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), other.ckpt_tree())
        del other
        gc.collect()
        array_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(other_target))
        print(f"{cfg}\nparams: {n_params:,}; checkpoint arrays (params + AdamW state + rng): "
              f"{array_bytes:,} bytes ({array_bytes / 1e6:.1f} MB)\n{jax.device_count()} "
              f"{jax.devices()[0].platform} devices on {os.cpu_count()} cores; saved from dp4 x "
              f"mp2, restored onto dp4 x mp2 and dp2 x mp4; median of {args.repeats}", flush=True)
        results = {}
        for fmt in args.formats.split(","):
            results[fmt] = bench_format(fmt, root, params, apply_fn, other_target, args.repeats)
            gc.collect()  # frees the format's trainer (its jitted steps refer back to it)
    keys = ("save", "restore", "restore other", "MB", "sha256")
    base = results.get("orbax")
    print("| format | save s | restore s (same layout) | restore s (other layout) | MB on disk | "
          "sha256 s (1 pass) |\n|---|---:|---:|---:|---:|---:|")
    for fmt, r in results.items():
        cells = [f"{r[k]:.2f}" if k != "MB" else f"{r[k]:,.1f}" for k in keys]
        if base:  # ratio against orbax, except for the hashing column
            cells[:4] = [f"{c} ({r[k] / base[k]:.2f}x)" for c, k in zip(cells[:4], keys)]
        print(f"| {fmt} | " + " | ".join(cells) + " |", flush=True)
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.1f} GB (the 8 "
          "simulated devices' memory included; dp replicas are real copies)")


if __name__ == "__main__":
    from provenance import print_provenance
    print_provenance()
    main()
