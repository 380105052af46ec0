"""The zoo's MoE block against the dense MLP of equal active parameters, one training step each
(forward and backward of a loss over the block's output, jitted), timed side by side in one run.

* ``dense``: a gated MLP of intermediate size ``top_k * expert_size``: what each token computes
  in the MoE block, as one matmul chain;
* ``dropless``: the MoE block, ``capacity_factor=None`` (sorted pairs, ``jax.lax.ragged_dot``);
* ``capacity 1.25``: the MoE block with each expert's capacity 1.25x an even share (pairs
  written to their slots and read back by index, ``expert_parallel.dispatch``/``combine``);
* ``experts only (1.25)``: the capacity path's batched expert matmuls alone, on a full buffer:
  the ceiling of the capacity path's speed;
* with ``--ep N`` (N simulated CPU devices), ``EP N dropless`` and ``EP N capacity 1.25``: the
  same under ``expert_parallel`` over a ``dp`` axis of N devices (all_to_all there and back).
  Simulated devices share the host's cores: these rows show the path runs, not EP's speed.

Printed per row: the median step time over ``--repeats`` timed steps (after one compiling
step; the rows are timed in turn, so a shared machine's load falls on each alike), and its speed
relative to the dense step (issue 44's target for the capacity path: at least 0.75x). The
router's matmul and the auxiliary losses are the MoE block's own cost.

    python bench/moe_step.py [--tokens 4096 --hidden 512 --experts 8 --top_k 2 --expert_size 512]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from flax import nnx  # noqa: E402  (jax reads XLA_FLAGS when it first runs, not on import)
from provenance import print_provenance  # noqa: E402


def compiled_step(module, x, mesh=None):
    """One jitted forward + backward of ``sum(sin(module(x)))``, compiled: a function running
    it to completion."""
    import jax
    import jax.numpy as jnp

    from redco_zoo_models.expert_parallel import expert_parallel
    graphdef, params = nnx.split(module, nnx.Param)

    def loss(params):
        with expert_parallel(mesh):
            out = nnx.merge(graphdef, params)(x)
        y, aux = out if isinstance(out, tuple) else (out, {"aux_loss": 0.0})
        return jnp.sum(jnp.sin(y)) + aux["aux_loss"]
    step = jax.jit(jax.grad(loss))
    jax.block_until_ready(step(params))  # compile
    return lambda: jax.block_until_ready(step(params))


class ExpertsOnly(nnx.Module):
    """The capacity path's batched expert matmuls alone, on a full (E, C, H) buffer (the input
    rows repeated): their speed is the capacity path's ceiling, which adds the router and the
    slots written and read around them."""

    def __init__(self, moe, n_tokens: int):
        self.experts, self.capacity = moe.experts, moe.cfg.capacity(n_tokens)

    def __call__(self, x):
        import jax.numpy as jnp
        n_experts, n_rows = self.experts.gate_proj.shape[0], self.experts.gate_proj.shape[0] * \
            self.capacity
        rows = jnp.tile(x, (-(-n_rows // x.shape[0]), 1))[:n_rows]
        return self.experts.batched(rows.reshape(n_experts, self.capacity, x.shape[-1]))


def median_times(steps: dict, repeats: int) -> dict:
    """Median seconds of each step, timed round-robin (a shared machine's load falls on every
    row alike)."""
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, run in steps.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top_k", type=int, default=2)
    parser.add_argument("--expert_size", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ep", type=int, default=0, help="also time EP over this many "
                        "simulated CPU devices")
    args = parser.parse_args()
    if args.ep:
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + \
            f" --xla_force_host_platform_device_count={args.ep}"
    import jax

    from redco.sharding import make_mesh
    from redco_zoo_models.layers import GatedMLP
    from redco_zoo_models.moe import MoE, MoEConfig
    print_provenance()
    x = jax.random.normal(jax.random.PRNGKey(0), (args.tokens, args.hidden))

    def moe(capacity_factor):
        return MoE(MoEConfig(args.hidden, args.experts, args.top_k, args.expert_size,
                             capacity_factor=capacity_factor), nnx.Rngs(0))
    rows = [("dense", GatedMLP(args.hidden, args.top_k * args.expert_size, "silu", nnx.Rngs(0)),
             None), ("dropless", moe(None), None), ("capacity 1.25", moe(1.25), None)]
    if args.ep:
        mesh = make_mesh(jax.devices()[:args.ep], 1)
        rows += [(f"EP {args.ep} dropless", moe(None), mesh),
                 (f"EP {args.ep} capacity 1.25", moe(1.25), mesh)]
    print(f"{args.tokens} tokens, hidden {args.hidden}, {args.experts} experts of "
          f"{args.expert_size}, top {args.top_k}; dense MLP of {args.top_k * args.expert_size}")
    rows.insert(3, ("experts only (1.25)", ExpertsOnly(moe(1.25), args.tokens), None))
    seconds = median_times({name: compiled_step(module, x, mesh) for name, module, mesh in rows},
                           args.repeats)
    for name, s in seconds.items():
        print(f"{name:>24}: {s * 1e3:8.1f} ms/step, {seconds['dense'] / s:5.2f}x dense speed")


if __name__ == "__main__":
    main()
