"""Compile seconds of a Qwen3-VL-shaped vision tower's training step, its blocks stored stacked
and scanned (the image-text model's ``scan_layers``: ``redco_zoo_models.layer_scan.blocks``)
against unrolled (the default), at each tower depth of ``--depths``.

The tower is Qwen3-VL-8B's (``Qwen3VisionModel``: width 1152, MLP 4304, 16 heads, 16-pixel
patches, 2 x 2 merge, features of width 4096), three DeepStack taps placed as 8, 16, 24 of 27
are (scaled to the depth), on one 448 x 448 image (784 patches, 196 tokens). The step is the
gradient of a loss of the features and the taps with respect to every param, jitted and compiled
from abstract params (nothing allocated) on one CPU device with XLA's default flags (this script
sets XLA_FLAGS to nothing else). Printed: the seconds of ``lower`` + ``compile`` (and of
``lower`` alone), the least of ``--repeats`` builds (a loaded machine's noise is one-sided),
scanned and unrolled built in turn, and XLA's temp bytes of the compiled step.

    python bench/tower_scan_compile.py                 # depths 8 32
    python bench/tower_scan_compile.py --depths 8 16 27 32
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ["XLA_FLAGS"] = ""
SHAPE = dict(hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
             spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=4096,
             num_position_embeddings=2304, hidden_act="gelu_pytorch_tanh")
GRID = [[1, 28, 28]]  # one 448 x 448 image: 28 x 28 patches


def compiled(depth: int, scan: bool, deepstack: bool = True) -> dict:
    """The tower's gradient step at ``depth``, lowered and compiled: ``lower_s``, ``compile_s``
    (both together), ``temp_mb``."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from redco_zoo_models.qwen3_vision import Qwen3VisionConfig, Qwen3VisionModel, interpolation
    taps = tuple(i * depth // 27 for i in (8, 16, 24)) if deepstack else ()
    cfg = Qwen3VisionConfig(depth=depth, deepstack_visual_indexes=taps, **SHAPE)

    def build():
        tower = Qwen3VisionModel(cfg, nnx.Rngs(0))
        if scan:
            tower.stack_blocks()
        return tower
    graphdef, params = nnx.split(nnx.eval_shape(build), nnx.Param)
    layout = interpolation(GRID, cfg)
    pixels = jax.ShapeDtypeStruct((784, cfg.patch_features()), jnp.float32)

    def loss(p, x):
        features, deep = nnx.merge(graphdef, p)(x, layout)
        return sum(jnp.mean(f ** 2) for f in [features, *deep])
    t0 = time.perf_counter()
    lowered = jax.jit(jax.grad(loss)).lower(params, pixels)
    t1 = time.perf_counter()
    step = lowered.compile()
    return {"lower_s": t1 - t0, "compile_s": time.perf_counter() - t0,
            "temp_mb": step.memory_analysis().temp_size_in_bytes / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no_deepstack", action="store_true",
                        help="no DeepStack taps (Qwen3.5's tower)")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from provenance import print_provenance
    print_provenance()
    taps = "no DeepStack taps" if args.no_deepstack else "3 DeepStack taps"
    print(f"Qwen3-VL-8B's tower shape, one 448 x 448 image (784 patches), {taps}, grad of "
          f"every param, 1 CPU device, XLA's default flags; compile s = lower + compile, the "
          f"least of {args.repeats}")
    print(f"{'blocks':>6} | {'compile scan s':>14} | {'compile unrolled s':>18} | "
          f"{'lower scan s':>12} | {'lower unrolled s':>16} | "
          f"{'temp scan MB':>12} | {'temp unrolled MB':>16}")
    rows = []
    for depth in args.depths:
        runs = [{scan: compiled(depth, scan, not args.no_deepstack) for scan in (True, False)}
                for _ in range(args.repeats)]
        row = {scan: {k: min(run[scan][k] for run in runs) for k in runs[0][scan]}
               for scan in (True, False)}
        rows.append(row)
        print(f"{depth:>6} | {row[True]['compile_s']:>14.1f} | {row[False]['compile_s']:>18.1f} | "
              f"{row[True]['lower_s']:>12.1f} | {row[False]['lower_s']:>16.1f} | "
              f"{row[True]['temp_mb']:>12.1f} | {row[False]['temp_mb']:>16.1f}", flush=True)
    first, last = rows[0], rows[-1]
    print(f"compile at {args.depths[-1]} blocks / at {args.depths[0]}: scanned "
          f"{last[True]['compile_s'] / first[True]['compile_s']:.2f}x, unrolled "
          f"{last[False]['compile_s'] / first[False]['compile_s']:.2f}x")


if __name__ == "__main__":
    main()
