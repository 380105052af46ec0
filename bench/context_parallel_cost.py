"""What context parallelism's attention moves and holds, from the compiled HLO (ahead of time,
nothing runs): forward and backward of ``redco_zoo_models.context_parallel`` for one sequence
split 2, 4 and 8 ways on simulated devices, both strategies, beside the formula.

Formula, per device, fp32: the forward pass brings in the other devices' keys and values,
``2 x (k-1)/k x N x KV x D x 4`` bytes, and their int32 positions and segment ids, ``2 x
(k-1)/k x N x 4``; the backward pass sends the keys' and values' gradients back, as many bytes
as the keys and values. All-gather moves them as all-gathers and reduce-scatters, ring as
``k-1`` collective-permutes each way. Bytes are
counted as a ring algorithm moves them (``bench/sharding_quality.py``'s parser). Temp memory is
XLA's ``temp_size_in_bytes`` of one device's program: the attention scores dominate, (N/k) x N
for all-gather and (N/k) x (N/k) per step for ring.

Run:  python bench/context_parallel_cost.py [--seq_len 4096] 2>/dev/null
"""
from __future__ import annotations

import argparse
import os

if __name__ == "__main__":  # before jax starts
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from sharding_quality import parse_collectives  # noqa: E402

from redco_zoo_models.context_parallel import attend_split  # noqa: E402

H, KV, D = 8, 8, 64


def compiled(n: int, k: int, strategy: str):
    """The attention's forward and backward on inputs already laid out (balanced, split over
    ``cp``, as a batch arrives): what the strategy moves, not the layout's conversion."""
    mesh = Mesh(np.array(jax.devices()[:k]), ("cp",))
    split = NamedSharding(mesh, P(None, "cp"))
    q = jax.ShapeDtypeStruct((1, n, H, D), jnp.float32, sharding=split)
    kv = jax.ShapeDtypeStruct((1, n, KV, D), jnp.float32, sharding=split)
    ids = jax.ShapeDtypeStruct((1, n), jnp.int32, sharding=split)
    attention = jax.shard_map(
        lambda q, k_, v, pos, seg: attend_split(q, k_, v, pos, pos, seg, seg, "cp", strategy),
        mesh=mesh, in_specs=(P(None, "cp"),) * 5, out_specs=P(None, "cp"))

    def loss(q, k_, v, pos, seg):
        return jnp.sum(attention(q, k_, v, pos, seg))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, ids, ids).compile()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq_len", type=int, default=4096)
    n = parser.parse_args().seq_len
    print(f"one sequence of {n} tokens, {H} query and {KV} key/value heads of {D}, fp32; "
          "forward + backward")
    print("| k | strategy | collective bytes / device (MiB) | formula (MiB) | ops | "
          "temp memory / device (MiB) |\n|---|---|---:|---:|---|---:|")
    for k in (1, 2, 4, 8):
        formula = (k - 1) / k * n * (2 * KV * D * 4 + 2 * 4 + 2 * KV * D * 4) / 2 ** 20
        for strategy in ("all_gather", "ring"):
            program = compiled(n, k, strategy)
            found = parse_collectives(program.as_text(), k)
            moved = sum(found["ring"].values()) / 2 ** 20
            ops = ", ".join(f"{op} x{c}" for op, c in sorted(found["count"].items())) or "-"
            temp = program.memory_analysis().temp_size_in_bytes / 2 ** 20
            print(f"| {k} | {strategy} | {moved:.1f} | {formula:.1f} | {ops} | {temp:.0f} |")


if __name__ == "__main__":
    from provenance import print_provenance
    print_provenance()
    main()
