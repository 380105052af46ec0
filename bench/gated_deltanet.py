"""A Gated DeltaNet layer's training step against a full-attention layer of equal width, and the
chunked delta rule against its plain recurrence, on CPU.

* ``step``: one forward and backward (the gradient of the sum of outputs with respect to the
  params) of a zoo decoder layer at width ``--width`` (heads of 64), batch 1, at each length of
  ``--lengths``: the Qwen3.5 layer's ``GatedDeltaNet`` mixer (chunks of 64) against the
  ``Attention`` of a Qwen3-shaped layer (causal, tiled past one block). Printed: each one's
  median time over ``--repeats`` runs (compiled ahead, no warm-up run) and their ratio.
* ``rule``: ``gated_deltanet.chunked`` against ``gated_deltanet.recurrent`` on the same inputs
  (8 heads of 64 at each length): the largest difference of outputs (they compute the same
  thing, so it should be float32 rounding, < 1e-5) and the time ratio.

    python bench/gated_deltanet.py [--lengths 2048 8192 32768 --width 512 --repeats 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from provenance import print_provenance  # noqa: E402


def timed(fn, *args, repeats: int) -> float:
    """The median seconds of ``repeats`` runs of the jitted ``fn``, compiled ahead (no warm-up
    run: at 32k tokens one attention step takes many minutes on a CPU)."""
    import jax
    compiled = fn.lower(*args).compile()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def mixers(width: int):
    """``{name: (module, call(module, x))}`` at ``width``, both from ``DecoderConfig``."""
    from flax import nnx

    from redco_zoo_models.decoder import Attention
    from redco_zoo_models.decoder_config import DecoderConfig, Mixer
    from redco_zoo_models.gated_deltanet import GatedDeltaNet
    heads = width // 64
    cfg = DecoderConfig(hidden_size=width, num_attention_heads=heads, num_key_value_heads=heads,
                        head_dim=64, num_hidden_layers=1, mixers=(Mixer.GATED_DELTANET,),
                        linear_num_key_heads=heads, linear_num_value_heads=heads,
                        linear_key_head_dim=64, linear_value_head_dim=64)
    rngs = nnx.Rngs(0)
    return {"gated_deltanet": (GatedDeltaNet(cfg.delta_net(), rngs), lambda m, x: m(x)[0]),
            "attention": (Attention(cfg, 0, rngs), lambda m, x: m(x, positions(x), None)[0])}


def positions(x):
    import jax.numpy as jnp
    return jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])


def step_times(width: int, n: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx
    x = jax.random.normal(jax.random.PRNGKey(0), (1, n, width))
    out = {}
    for name, (module, call) in mixers(width).items():
        graphdef, params = nnx.split(module)
        loss = lambda p, x: jnp.sum(call(nnx.merge(graphdef, p), x))  # noqa: E731
        out[name] = timed(jax.jit(jax.grad(loss)), params, x, repeats=repeats)
    return out


def rule_check(n: int, repeats: int) -> tuple[float, float, float]:
    """``(max |chunked - recurrent|, chunked seconds, recurrent seconds)``."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from redco_zoo_models.gated_deltanet import chunked, recurrent
    keys = jax.random.split(jax.random.PRNGKey(1), 5)
    q, k, v = (jax.random.normal(key, (1, n, 8, 64)) for key in keys[:3])
    g = -jax.nn.softplus(jax.random.normal(keys[3], (1, n, 8)))
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (1, n, 8)))
    run_chunked = jax.jit(lambda *a: chunked(*a, 64)[0])
    run_recurrent = jax.jit(lambda *a: recurrent(*a)[0])
    args = (q, k, v, g, beta)
    diff = float(jnp.max(jnp.abs(run_chunked(*args) - run_recurrent(*args))))
    return (np.float32(diff), timed(run_chunked, *args, repeats=repeats),
            timed(run_recurrent, *args, repeats=repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print_provenance()
    print(f"{'tokens':>7} {'deltanet s':>11} {'attention s':>12} {'attn/delta':>11} | "
          f"{'max|chunk-rec|':>15} {'chunked s':>10} {'recurrent s':>12} {'rec/chunk':>10}")
    for n in args.lengths:
        step = step_times(args.width, n, args.repeats)
        diff, c, r = rule_check(n, args.repeats)
        print(f"{n:>7} {step['gated_deltanet']:>11.3f} {step['attention']:>12.3f} "
              f"{step['attention'] / step['gated_deltanet']:>11.2f} | {diff:>15.2e} {c:>10.3f} "
              f"{r:>12.3f} {r / c:>10.2f}", flush=True)


if __name__ == "__main__":
    main()
