"""Key/value cache bytes per token of published decoders, read from the cache a model allocates
(``model.init_cache``, traced, not run: nothing is allocated) in bfloat16: per token over all
layers, and per device as an engine places it on 8 devices with tensor parallelism over 8
(``engine_memory.cache_sharding``: key/value heads over ``mp`` where they divide); and how
many tokens 10 GB of cache hold. DeepSeek-V3 (multi-head latent attention,
``redco_zoo_models.mla``) caches its latent: run this script against a checkout from before
the latent cache to get the up-projected figures (each head's key and value).

Then the engine's decode step for DeepSeek-V3's first ``--layers`` layers (dense: attention is
the same in every layer, and a layer of 256 experts would add its own weights and temporaries
to both sides alike), compiled ahead of time (``decode_layout.compile_decode_step``: params
abstract, fp32, as the decode layout places them at mp 8 on 8 devices; ``--rows`` rows of
``--max_len`` slots, bf16 cache): the params a device holds, its peak (``memory_analysis``)
and XLA's FLOP count for the step (``cost_analysis``).

    python bench/mla_cache.py [--presets deepseek-v3,llama-3.1-70b,...] [--layers 3
        --rows 32 --max_len 4096]
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + \
    " --xla_force_host_platform_device_count=8"
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from provenance import print_provenance  # noqa: E402

from redco.sharding import make_mesh  # noqa: E402
from redco_zoo_models.decode_layout import (  # noqa: E402
    compile_decode_step,
    decode_shardings,
    held_bytes,
    peak_bytes,
)
from redco_zoo_models.decoder import DecoderConfig, DecoderLM  # noqa: E402
from redco_zoo_models.engine_memory import cache_sharding  # noqa: E402
from redco_zoo_models.presets import preset  # noqa: E402

PRESETS = "deepseek-v3,llama-3.1-70b,qwen3-30b-a3b,mixtral-8x7b"
GiB = 2 ** 30


def row(name: str, mesh) -> str:
    """One preset's line: its cache's numbers per token and layer, bytes per token, per device
    at mp 8, and tokens per 10 GB."""
    config = DecoderConfig.from_hf(preset(name))
    model = nnx.eval_shape(lambda: DecoderLM(config, rngs=nnx.Rngs(0)))
    cache = jax.eval_shape(lambda: model.init_cache(1, 1, jnp.bfloat16))
    per_layer = sum(x.size for x in jax.tree.leaves(cache[0]))
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
    sharding = cache_sharding(mesh, cache)
    on_device = sum(np.prod(sharding.shard_shape(x.shape)) * x.dtype.itemsize
                    for x in jax.tree.leaves(cache))
    shapes = " + ".join(f"{k} {tuple(x.shape[2:])}" for k, x in cache[0].items())
    return (f"{name:>15} {config.num_hidden_layers:>6} {shapes:>26} {per_layer:>9,} "
            f"{total:>11,} {on_device:>11,} {10e9 / total:>13,.0f}")


def decode_step(args, mesh) -> None:
    """DeepSeek-V3's first ``args.layers`` layers: the decode step's held params, peak and
    FLOPs per device, by AOT."""
    config = DecoderConfig.from_hf(dict(preset("deepseek-v3"), num_hidden_layers=args.layers))
    model = nnx.eval_shape(lambda: DecoderLM(config, rngs=nnx.Rngs(0)))
    params = nnx.state(model, nnx.Param)
    shardings = decode_shardings(params, mesh)
    compiled = compile_decode_step(model, params, mesh, shardings, args.rows, args.max_len,
                                   jnp.bfloat16)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    print(f"\ndecode step, deepseek-v3's first {args.layers} layers (dense), {args.rows} rows x "
          f"{args.max_len} slots, one token a row, mp 8 on 8 devices, by AOT (per device)")
    print(f"{'params held':>12} {'peak':>9} {'GFLOP':>9}")
    print(f"{held_bytes(params, shardings) / GiB:>8.2f} GiB {peak_bytes(compiled) / GiB:>5.2f} GiB "
          f"{cost.get('flops', float('nan')) / 1e9:>9.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default=PRESETS)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--max_len", type=int, default=4096)
    args = parser.parse_args()
    print_provenance()
    mesh = make_mesh(jax.devices(), 8)
    print("bf16 cache; per device: 8 devices, tensor parallel over 8 (mp), as the engine "
          "places it")
    print(f"{'preset':>15} {'layers':>6} {'a layer caches (heads, width)':>26} "
          f"{'per layer':>9} {'bytes/token':>11} {'per device':>11} {'tokens/10 GB':>13}")
    for name in args.presets.split(","):
        print(row(name, mesh))
    decode_step(args, mesh)


if __name__ == "__main__":
    main()
