"""redco-safetensors: PyTorch names (``torch_name``), a checkpoint's ``model.safetensors`` is a
PyTorch state dict, and shards are sliced out of the transposed tensors onto any mesh."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file

from redco import checkpointing, plugins
from redco.sharding import named_leaves
from redco_safetensors import SafetensorsFormat, stored_names, torch_name


@pytest.mark.parametrize("path, ndim, name, perm", [
    ("model/layers/0/mlp/up_proj/kernel", 2, "model.layers.0.mlp.up_proj.weight", (1, 0)),
    ("vit/embeddings/patch/kernel", 4, "vit.embeddings.patch.weight", (3, 2, 0, 1)),
    ("model/embed_tokens/embedding", 2, "model.embed_tokens.weight", None),
    ("model/norm/scale", 1, "model.norm.weight", None),
    ("lm_head/bias", 1, "lm_head.bias", None),
    ("attn/qkv/kernel", 3, "attn.qkv.kernel", None),  # a DenseGeneral kernel has no torch twin
])
def test_torch_name(path, ndim, name, perm):
    assert torch_name(path, ndim) == (name, perm)


def test_two_arrays_stored_under_one_name_are_refused():
    with pytest.raises(ValueError, match="params/a/kernel and params/a/weight would both be "
                                         "stored as a.weight in safetensors"):
        stored_names({"params/a/kernel": 2, "params/a/weight": 2})
    assert stored_names({"params/a/kernel": 2, "opt_state/a/kernel": 2}) == {
        "params/a/kernel": ("model.safetensors", "a.weight", (1, 0)),
        "opt_state/a/kernel": ("state.safetensors", "opt_state/a/kernel", None)}


def mesh(shape):
    return Mesh(np.array(jax.devices()).reshape(shape), ("dp", "mp"))


def sample_tree():
    """Params of every kind torch_name maps, sharded over a 4 x 2 mesh, and other state."""
    rng = np.random.default_rng(0)
    arrays = {
        "params": {"conv": {"kernel": rng.normal(size=(3, 3, 4, 8)).astype(np.float32)},
                   "dense": {"kernel": rng.normal(size=(8, 16)).astype(jnp.bfloat16),
                             "bias": rng.normal(size=(16,)).astype(np.float32)},
                   "embed": {"embedding": rng.normal(size=(32, 8)).astype(np.float32)},
                   "norm": {"scale": rng.normal(size=(8,)).astype(np.float32)}},
        "opt_state": {"count": np.asarray(7, np.int32),
                      "mu": {"dense": {"kernel": rng.normal(size=(8, 16)).astype(np.float32)}}},
    }
    specs = {"params/conv/kernel": P(None, None, "dp", "mp"), "params/dense/kernel": P("dp", "mp"),
             "params/embed/embedding": P("dp", None)}
    m = mesh((4, 2))
    leaves = [jax.device_put(x, NamedSharding(m, specs.get(path, P())))
              for path, x in named_leaves(arrays)]
    return arrays, jax.tree.unflatten(jax.tree.structure(arrays), leaves)


def test_registered_from_its_distribution():
    assert isinstance(plugins.lookup("checkpoint_formats", "safetensors"), SafetensorsFormat)
    assert plugins.plugin_sources["safetensors"].startswith("redco-safetensors ")


def test_model_safetensors_is_a_pytorch_state_dict_and_restores_onto_another_mesh(tmp_path):
    arrays, tree = sample_tree()
    path = checkpointing.save(str(tmp_path), "step_1", tree, {"step": 1}, "safetensors")
    assert sorted(os.listdir(os.path.join(path, "state"))) == ["model.safetensors",
                                                                "state.safetensors"]
    torch = load_file(os.path.join(path, "state", "model.safetensors"))
    assert sorted(torch) == ["conv.weight", "dense.bias", "dense.weight", "embed.weight",
                             "norm.weight"]
    np.testing.assert_array_equal(torch["conv.weight"],
                                  arrays["params"]["conv"]["kernel"].transpose(3, 2, 0, 1))
    np.testing.assert_array_equal(torch["dense.weight"], arrays["params"]["dense"]["kernel"].T)
    assert torch["dense.weight"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(torch["embed.weight"], arrays["params"]["embed"]["embedding"])
    assert sorted(load_file(os.path.join(path, "state", "state.safetensors"))) == [
        "opt_state/count", "opt_state/mu/dense/kernel"]

    other = mesh((2, 4))  # shards cut across the transposed axes of the stored tensors
    specs = {"params/conv/kernel": P(None, None, "mp", "dp"), "params/dense/kernel": P("mp", "dp"),
             "params/embed/embedding": P(None, "mp")}
    target = jax.tree.unflatten(jax.tree.structure(arrays), [
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(other, specs.get(p, P())))
        for p, x in named_leaves(arrays)])
    restored, meta = checkpointing.load(path, target)
    assert meta["format"] == "safetensors"
    for (p, got), (_, want) in zip(named_leaves(restored), named_leaves(arrays)):
        assert got.sharding.spec == specs.get(p, P()), p
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=p)
        assert got.dtype == want.dtype, p
