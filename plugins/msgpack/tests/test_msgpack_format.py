"""redco-msgpack: a checkpoint's ``state.msgpack`` is Flax's serialization of the tree as nested
dicts, restores onto another mesh, and a file that holds anything but arrays of numbers is
refused with what it holds."""
import os

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import pytest
from flax import serialization
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from redco import checkpointing, plugins
from redco.sharding import named_leaves
from redco_msgpack import MsgpackFormat


def mesh(shape):
    return Mesh(np.array(jax.devices()).reshape(shape), ("dp", "mp"))


def on(m, spec_of, arrays):
    leaves = [jax.device_put(x, NamedSharding(m, spec_of(x))) for _, x in named_leaves(arrays)]
    return jax.tree.unflatten(jax.tree.structure(arrays), leaves)


ARRAYS = {
    "params": {"layers": {"0": {"kernel": np.arange(64, dtype=np.float32).reshape(8, 8)},
                          "1": {"kernel": (np.arange(64).reshape(8, 8) / 7).astype(jnp.bfloat16)}}},
    "step": np.asarray(3, np.int32),
}


def test_registered_from_its_distribution():
    assert isinstance(plugins.lookup("checkpoint_formats", "msgpack"), MsgpackFormat)
    assert plugins.plugin_sources["msgpack"].startswith("redco-msgpack ")


def test_state_msgpack_is_flax_serialization_and_restores_onto_another_mesh(tmp_path):
    tree = on(mesh((4, 2)), lambda x: P("dp", "mp") if x.ndim == 2 else P(), ARRAYS)
    path = checkpointing.save(str(tmp_path), "step_3", tree, {"step": 3}, "msgpack")
    assert os.listdir(os.path.join(path, "state")) == ["state.msgpack"]
    with open(os.path.join(path, "state", "state.msgpack"), "rb") as f:
        flax_read = serialization.msgpack_restore(f.read())
    assert sorted(flax_read["params"]["layers"]) == ["0", "1"]
    for p, want in named_leaves(ARRAYS):
        got = checkpointing.leaf_at(flax_read, p)
        np.testing.assert_array_equal(got, want, err_msg=p)
        assert got.dtype == want.dtype, p

    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          on(mesh((2, 4)), lambda x: P("mp", "dp") if x.ndim == 2 else P(), ARRAYS))
    restored, _ = checkpointing.load(path, target)
    for (p, got), (_, want) in zip(named_leaves(restored), named_leaves(ARRAYS)):
        assert got.sharding.spec == (P("mp", "dp") if want.ndim == 2 else P()), p
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=p)
        assert got.dtype == want.dtype, p


@pytest.mark.parametrize("content, message", [
    (msgpack.packb([1, 2]), "expected a dict of arrays, found list"),
    (msgpack.packb({"params": {"w": "rm -rf /"}}), "params/w is a str, not an array of numbers"),
])
def test_a_file_of_anything_but_arrays_is_refused(tmp_path, content, message):
    (tmp_path / "state.msgpack").write_bytes(content)
    target = {"params": {"w": jax.ShapeDtypeStruct((2,), np.float32, sharding=jax.sharding.
                                                   SingleDeviceSharding(jax.devices()[0]))}}
    with pytest.raises(ValueError, match=message):
        MsgpackFormat().load(str(tmp_path), target)
