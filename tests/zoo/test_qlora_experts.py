"""QLoRA over a MoE model (``redco_zoo_models.quantized_experts``): ``--quantize_base`` holds the
experts quantised too, each expert's [in, out] matrix as a kernel's (NF4 against the code book
published with QLoRA, int8 per output channel: dequantised here in numpy and within each
format's bound of the checkpoint's weights), dequantised in the step (the model's logits with
LoRA are the exported, dequantised and merged model's) and written dequantised on export; under
expert parallelism (dp 4 x mp 2, ``auto+ep``) the codes and their scales split together on the
experts over dp, and LoRA steps give one device's adapters and loss, the layers unrolled or
stacked and scanned (``scan_layers``: each layer's experts quantised alone, their parts stacked)."""
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file
from test_lm import markov_chain, sample_chains
from test_qlora import PUBLISHED_NF4, lora_trainer, nf4_bound, per_layer

from redco.tree_paths import named_leaves
from redco_zoo_models import LlamaConfig, LlamaForCausalLM, add_lora, from_pretrained, split_model
from redco_zoo_models.hf import save_pretrained
from redco_zoo_models.lora import lora_layers
from redco_zoo_models.quantized_experts import part_spec
from redco_zoo_models.toy import TINY_FAMILIES

# qwen3-moe, 2 layers (each 4 experts, top 2: scanned, one stack), every input dim NF4's 64 x k
MOE = dict(TINY_FAMILIES["qwen3-moe"], hidden_size=64, intermediate_size=128,
           moe_intermediate_size=128, num_hidden_layers=2, mlp_only_layers=[])
EXPERTS = "model/layers/0/mlp/experts"
STACKED = "model/layers/0:2/mlp/experts"  # (scanned: both layers' experts, layer axis first)
CODES = {"nf4": np.uint8, "int8": np.int8}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A random tiny Qwen3-MoE saved as a HuggingFace directory (experts one tensor each)."""
    path = str(tmp_path_factory.mktemp("qexperts") / "base")
    save_pretrained(LlamaForCausalLM(LlamaConfig.from_hf(MOE), nnx.Rngs(0)), path)
    return path


def checkpoint_experts(model_dir, weight):
    """``weight`` (gate_proj, ...) of layer 0's experts from the checkpoint, (E, in, out)."""
    tensors = load_file(f"{model_dir}/model.safetensors")
    return np.stack([tensors[f"model.layers.0.mlp.experts.{e}.{weight}.weight"].T
                     for e in range(MOE["num_experts"])])


def numpy_dequantised(parts, fmt):
    """Each expert's matrix from its parts, written out: NF4 codes two a byte (row 2i low
    nibble) on the published code book times their block's absmax (int8 x a scale per 256
    columns, plus the offset); int8 codes times their column's scale."""
    parts = {k: np.asarray(v, np.float32 if k != "codes" else v.dtype) for k, v in parts.items()}
    if fmt == "int8":
        return parts["codes"].astype(np.float32) * parts["scale"][:, None, :]
    codes = parts["codes"]
    index = np.stack([codes & 15, codes >> 4], axis=2).reshape(codes.shape[0], -1, codes.shape[2])
    group = parts["absmax"].shape[2] // parts["absmax_scale"].shape[2]
    absmax = parts["absmax"] * np.repeat(parts["absmax_scale"], group, axis=2) + \
        parts["absmax_offset"][:, None, None]
    return np.asarray(PUBLISHED_NF4, np.float32)[index] * np.repeat(absmax, 64, axis=1)


def expert_parts(model, weight):
    """``{part: array}`` of ``weight``'s parts in layer 0's experts (codes under its name)."""
    block = nnx.state(model, nnx.Param)
    named = {p.rpartition("/")[2]: v for p, v in named_leaves(block) if p.startswith(EXPERTS)}
    return {("codes" if k == weight else k.removeprefix(f"{weight}_")): v
            for k, v in named.items() if k == weight or k.startswith(f"{weight}_")}


def assert_scanned_export_is_unrolled(base, fmt, unrolled_dir, out):
    """Loaded scanned (every layer's experts in one stack) and then quantised (the stack's
    layers each alone, ``quantize_linears`` on the real model), the model's export holds each
    layer's experts exactly as the unrolled load's export does."""
    from redco_zoo_models.quantized_linear import quantize_linears
    model = from_pretrained(LlamaForCausalLM, base, scan_layers=True)
    quantize_linears(model, fmt)
    save_pretrained(model, out)
    want = load_file(f"{unrolled_dir}/model.safetensors")
    got = load_file(f"{out}/model.safetensors")
    experts = [name for name in want if ".mlp.experts." in name]
    assert len(experts) == MOE["num_hidden_layers"] * MOE["num_experts"] * 3
    for name in experts:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_experts_load_as_codes_and_compute_and_export_dequantised(base, tmp_path, fmt):
    """Loaded with ``quantize=fmt``, every expert weight is codes and scales whose numpy
    dequantisation is within the format's bound of the checkpoint's (per expert); with LoRA
    adapters (B drawn at random) the model's logits are those of its export (1e-5), which holds
    exactly that dequantisation and the adapters merged; a scanned model exports the same
    experts."""
    model = add_lora(from_pretrained(LlamaForCausalLM, base, quantize=fmt, scan_layers=False),
                     rank=4)
    for i, (_, layer) in enumerate(lora_layers(model)):
        layer.lora_b[...] = 0.1 * jax.random.normal(jax.random.PRNGKey(i), layer.lora_b.shape)
    save_pretrained(model, str(tmp_path / "merged"))
    for weight in ("gate_proj", "down_proj"):
        parts = expert_parts(model, weight)
        assert parts["codes"].dtype == CODES[fmt], {k: v.dtype for k, v in parts.items()}
        ours, w = numpy_dequantised(parts, fmt), checkpoint_experts(base, weight)
        bound = np.stack([nf4_bound(x) for x in w]) if fmt == "nf4" else \
            np.broadcast_to(np.abs(w).max(1, keepdims=True) / 254, w.shape)  # (per column)
        assert np.all(np.abs(ours - w) <= bound * (1 + 1e-5) + 1e-8)
        np.testing.assert_allclose(checkpoint_experts(tmp_path / "merged", weight), ours,
                                   rtol=0, atol=1e-6)
    assert_scanned_export_is_unrolled(base, fmt, tmp_path / "merged", str(tmp_path / "scanned"))
    exported = from_pretrained(LlamaForCausalLM, str(tmp_path / "merged"))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 16)))
    logits = [jax.jit(apply_fn)(params, ids) for apply_fn, params in
              (split_model(model), split_model(exported))]
    np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(logits[1]), rtol=1e-5,
                               atol=1e-5)


# layer 0's NF4 expert parts under EP at dp 4 x mp 2: all on the experts over dp, mp as the weight
EP_SPECS = {"gate_proj": ("dp", None, "mp"), "gate_proj_absmax": ("dp", None, "mp"),
            "gate_proj_absmax_scale": ("dp", None, None),  # (one column: mp left whole)
            "gate_proj_absmax_offset": ("dp",),
            "down_proj": ("dp", "mp", None), "down_proj_absmax": ("dp", "mp", None),
            "down_proj_absmax_scale": ("dp", "mp", None), "down_proj_absmax_offset": ("dp",)}


def padded(spec, ndim):
    return tuple(spec) + (None,) * (ndim - len(spec))


@pytest.fixture(scope="module")
def one_device_run(base):
    """``(rows, per-layer params before, after two LoRA updates of 32 rows, eval loss)`` over the
    NF4 base on one device, its layers unrolled: what the EP runs below must give."""
    transitions, stationary, _ = markov_chain()
    rows = sample_chains(transitions, stationary, 64, 17, seed=3)
    one = lora_trainer(base, "nf4", len(rows), 32, 3e-2, n_local_devices=1)
    before = per_layer(one.params)
    one.train_epoch(rows, 32, 0)
    assert one.step == 2
    return rows, before, per_layer(one.params), one.eval_loss(rows, 32)


def ep_trainer(base, rows, scan):
    """LoRA over the NF4 base at dp 4 x mp 2 with ``auto+ep``; ``scan``: layers stacked."""
    return lora_trainer(base, "nf4", len(rows), 8, 3e-2, scan=scan, n_model_shards=2,
                        sharding_rules="auto+ep")


def assert_trains_as_one_device(trainer, one_device_run):
    """Two updates of 8 rows a device: one device's adapters (per layer) and eval loss (1e-5)."""
    rows, _, want, loss = one_device_run
    trainer.train_epoch(rows, 8, 0)
    assert trainer.step == 2
    for path, value in per_layer(trainer.params).items():
        np.testing.assert_allclose(value, want[path], rtol=1e-5, atol=1e-5, err_msg=path)
    assert trainer.eval_loss(rows, 8) == pytest.approx(loss, rel=1e-5)
    assert "all_to_all" in trainer.lower_train_step(rows, 8).as_text()


def expert_specs(trainer, module):
    """``{param name: its spec, padded to its rank}`` of ``module``'s expert parts, whose
    codes are NF4's (uint8)."""
    named = {p.rpartition("/")[2]: v for p, v in named_leaves(trainer.params)
             if p.startswith(f"{module}/")}
    assert named["gate_proj"].dtype == named["down_proj"].dtype == np.uint8
    return {k: padded(v.sharding.spec, v.ndim) for k, v in named.items()}


def test_ep_steps_over_nf4_experts_are_one_devices_with_codes_and_scales_split_together(
        base, one_device_run):
    """Two LoRA updates over an NF4 base, dp 4 x mp 2 with ``auto+ep`` (one expert a device,
    sent its tokens by all_to_all) against one device: the same adapters and eval loss (1e-5,
    fp32). Every part of an expert weight is split on the experts over dp with its codes, and
    over mp as its weight (gate: output, down: input) where its dims divide."""
    split = ep_trainer(base, one_device_run[0], scan=False)
    assert_trains_as_one_device(split, one_device_run)
    got = expert_specs(split, EXPERTS)
    assert {k: got[k] for k in EP_SPECS} == EP_SPECS, got


def test_scanned_ep_steps_quantise_each_layers_experts_alone_and_are_one_devices(
        base, one_device_run):
    """The layers stacked and scanned (``scan_layers``: experts (2, E, in, out)), read from
    the checkpoint and quantised to NF4, under EP at dp 4 x mp 2: each layer's expert codes and
    scales (and adapters) exactly the unrolled model's (each layer quantised alone), two LoRA
    updates one unrolled device's adapters and eval loss (1e-5; the scan slices each layer's
    parts), every part split as the unrolled one behind a whole layer axis, and all_to_all."""
    scanned = ep_trainer(base, one_device_run[0], scan=True)
    np.testing.assert_equal(per_layer(scanned.params), one_device_run[1])
    assert_trains_as_one_device(scanned, one_device_run)
    got = expert_specs(scanned, STACKED)
    assert {k: got[k] for k in EP_SPECS} == {k: (None, *v) for k, v in EP_SPECS.items()}, got
    # a rule written at the stack's rank (its layer entry None) reads as one layer's
    assert part_spec(P(None, "dp", None, "mp"), (4, 1, 128)) == P("dp", None, "mp")


def test_the_expert_parallel_flag_splits_the_scales_with_their_codes():
    """``--expert_parallel`` over the ``auto`` rule set (``runner.params_rules``, its EP rules
    before the deployer's): the NF4 experts' parts laid out as under ``auto+ep`` above."""
    from redco import Deployer
    from redco.sharding import specs_from_rules
    from redco_zoo_models.quantized_linear import quantize_linears
    from redco_zoo_models.runner import params_rules
    cfg = replace(LlamaConfig.from_hf(MOE), scan_layers=False)  # (layer 0's experts unstacked)
    model = nnx.eval_shape(lambda: LlamaForCausalLM(cfg, nnx.Rngs(0)))
    quantize_linears(model, "nf4")
    params = nnx.state(model, nnx.Param)
    deployer = Deployer(jax_seed=0, workdir=None, verbose=False, n_model_shards=2)
    specs = specs_from_rules(params, params_rules(model, params, deployer, True), deployer.mesh)
    named = {p.rpartition("/")[2]: v for p, v in named_leaves(specs) if p.startswith(EXPERTS)}
    assert {k: padded(named[k], len(v)) for k, v in EP_SPECS.items()} == EP_SPECS, named
