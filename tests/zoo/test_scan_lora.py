"""LoRA on a scanned decoder's stacked layers (``redco.lora``, ``redco_zoo_models.lora``): the
stacked adapters start as the unrolled model's from the same seed, train on dp4 x mp2 as the
unrolled ones do (laid out as their kernels, behind an unsplit layer axis), and export (merged,
and PEFT's per-layer adapters) as the unrolled model exports. Against transformers and peft:
tests/zoo_parity/test_parity_lora.py, scanned."""
import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file
from scanned import check_equal_training, params_of

from redco import layer_stacks
from redco.tree_paths import named_leaves
from redco_zoo_models import LlamaConfig, LlamaForCausalLM, add_lora, save_pretrained
from redco_zoo_models.lora import save_peft_adapters
from redco_zoo_models.toy import TINY_FAMILIES

LLAMA = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2)
S, F = "sliding_attention", "full_attention"
GEMMA3 = LlamaConfig.from_hf(dict(  # groups (S, S, F) twice, stacked as 0:6:3 ..., then one
    TINY_FAMILIES["gemma3"], num_hidden_layers=7, layer_types=[S, S, F, S, S, F, S]))


@pytest.mark.parametrize("cfg", [dataclasses.replace(LLAMA, num_hidden_layers=11), GEMMA3],
                         ids=["llama-11", "gemma3"])
def test_stacked_adapters_start_as_the_unrolled_ones_from_the_same_seed(cfg):
    """Each layer's A (uniform, +-1/sqrt(in)) is the one its unrolled copy draws, layer 10's
    included (keys go by layer number, not by name: 10 after 2) and a group's interleaved
    layers (0:6:3, 1:6:3, ...); B zeros; adapters on every projection of every layer."""
    def init(scan: bool):  # (the base's weights zeros: adapters do not read them)
        graph, *states = nnx.split(nnx.eval_shape(lambda: LlamaForCausalLM(
            dataclasses.replace(cfg, scan_layers=scan), nnx.Rngs(0))))
        zeros = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), states)
        state = jax.jit(lambda z: nnx.state(add_lora(nnx.merge(graph, *z), rank=2, seed=3),
                                            nnx.Param))(zeros)
        return layer_stacks.unstack({p: np.asarray(x) for p, x in named_leaves(state)})
    got, want = init(True), init(False)
    assert got.keys() == want.keys()
    a_names = [p for p in want if p.endswith("/lora_a")]
    assert len(a_names) == 7 * cfg.num_hidden_layers
    for path in want:
        np.testing.assert_array_equal(got[path], want[path], err_msg=path)
    a = want["model/layers/10/mlp/down_proj/lora_a" if cfg is not GEMMA3 else
             "model/layers/6/mlp/down_proj/lora_a"]
    bound = 1 / np.sqrt(a.shape[0])
    assert np.abs(a).max() <= bound and np.abs(a).max() > 0.5 * bound
    assert not np.any(want["model/layers/1/self_attn/q_proj/lora_b"])


def test_scanned_lora_trains_as_the_unrolled_lora_on_dp4_mp2():
    """4 SGD updates of the adapters alone: equal losses, gradient norms and final params per
    layer; the base stays as drawn; each adapter is split as its kernel's (column-parallel
    q_proj: B on its output; row-parallel o_proj: A on its input), the layer axis whole."""
    specs, final, _ = check_equal_training(LLAMA, lora_rank=2)
    start = layer_stacks.unstack({p: np.asarray(x) for p, x in
                                  named_leaves(params_of(LLAMA, True, 2)[1])})
    moved = [p for p in final if not np.array_equal(final[p], start[p])]
    assert moved and all(p.endswith(("/lora_a", "/lora_b")) for p in moved), moved
    attn = "model/layers/0:3/self_attn"
    assert specs[f"{attn}/q_proj/lora_b"] == P(None, None, "mp")
    assert specs[f"{attn}/q_proj/lora_a"] == P()
    assert specs[f"{attn}/o_proj/lora_a"] == P(None, "mp", None)
    assert specs[f"{attn}/o_proj/lora_b"] == P()


def test_a_scanned_lora_models_exports_are_the_unrolled_ones(tmp_path):
    """The same params (adapters drawn, B not zero) saved merged and as PEFT's adapters,
    scanned and unrolled: the same tensors under the same names, merged ones = W + 8 A B."""
    files = {}
    for scan in (False, True):
        _, params = params_of(LLAMA, scan, 2)
        graph = nnx.graphdef(nnx.eval_shape(lambda: add_lora(LlamaForCausalLM(  # noqa: B023
            dataclasses.replace(LLAMA, scan_layers=scan), nnx.Rngs(0)), rank=2)))
        model = nnx.merge(graph, params)
        save_peft_adapters(model, str(tmp_path / f"{scan}-adapter"))
        save_pretrained(model, str(tmp_path / f"{scan}-merged"))
        files[scan] = [load_file(str(tmp_path / f"{scan}-{kind}" / name)) for kind, name in
                       (("merged", "model.safetensors"), ("adapter", "adapter_model.safetensors"))]
    for got, want in zip(files[True], files[False]):
        assert got.keys() == want.keys()
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    unrolled = dict(named_leaves(params_of(LLAMA, False, 2)[1]))
    q = "model/layers/2/self_attn/q_proj"
    merged = unrolled[f"{q}/kernel"] + 8.0 * unrolled[f"{q}/lora_a"] @ unrolled[f"{q}/lora_b"]
    np.testing.assert_allclose(files[True][0]["model.layers.2.self_attn.q_proj.weight"],
                               merged.T, rtol=1e-6)
    assert files[True][1]["base_model.model.model.layers.2.self_attn.q_proj.lora_A.weight"] \
        .shape == (2, 32)
