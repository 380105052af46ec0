"""``redco.hlo_collectives`` reads a compiled step's collectives: ops per kind and the bytes of
their results on one device, an asynchronous ``-start`` op by its outputs alone."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from redco.hlo_collectives import collectives
from redco.sharding import make_mesh

# The shapes of XLA's text: an async all-gather's result tuple holds its operand, then its
# output; an all-reduce-start's result is its output alone.
ASYNC = """
  %ag = (f32[4,8]{1,0}, f32[32,8]{1,0}) all-gather-start(f32[4,8]{1,0} %p), dimensions={0}
  %agd = f32[32,8]{1,0} all-gather-done((f32[4,8]{1,0}, f32[32,8]{1,0}) %ag)
  %ar = bf16[16]{0} all-reduce-start(bf16[16]{0} %q), to_apply=%add
  ROOT %a2a = s32[8,2]{1,0} all-to-all(s32[8,2]{1,0} %r), dimensions={0}
"""


def test_async_ops_count_their_outputs_and_dtypes_their_sizes():
    assert collectives(ASYNC) == {"all-gather": {"ops": 1, "bytes": 32 * 8 * 4},
                                  "all-reduce": {"ops": 1, "bytes": 16 * 2},
                                  "all-to-all": {"ops": 1, "bytes": 8 * 2 * 4}}


def test_a_compiled_all_gather_of_a_split_array():
    mesh = make_mesh(jax.devices()[:8], 1)  # dp = 8
    x = jax.device_put(np.ones((64, 16), np.float32), NamedSharding(mesh, P("dp")))
    gathered = jax.jit(lambda a: a * 2, out_shardings=NamedSharding(mesh, P()))
    found = collectives(gathered.lower(x).compile().as_text())
    assert found["all-gather"]["bytes"] == 64 * 16 * 4, found
    assert jnp.all(gathered(x) == 2)
