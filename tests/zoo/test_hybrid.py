"""Granite 4 hybrid (Mamba2 and attention layers, ``redco_zoo_models.mamba2``) with the zoo's
levers: stacked layers (``scan_layers``), bf16, LoRA on the Mamba2 output projections under
tensor parallelism, expert parallelism (under FSDP x TP with full remat), packed rows;
Nemotron-H's blocks (relu2 MLPs, ungated experts) under the tensor-parallel plan, LoRA and
quantised experts, and its hub config layout (``hybrid_override_pattern``).
Qwen3-Next's FSDP x TP with full remat: test_families.py; context parallelism:
test_recurrent_split.py; parity with transformers, generation and the serving engine:
tests/zoo_parity/."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scanned import first_layer_with

from redco import Deployer
from redco.tree_paths import named_leaves
from redco_zoo_models import LlamaConfig, LlamaForCausalLM, split_model
from redco_zoo_models.toy import TINY_FAMILIES

DENSE = LlamaConfig.from_hf(TINY_FAMILIES["granite-4-h-dense"])  # mamba, mamba, attention
# two layers, a Mamba2 one and an attention one, for the training tests (the tiny families'
# third layer repeats one of these)
TWO_LAYERS = {family: LlamaConfig.from_hf(dict(TINY_FAMILIES[family], num_hidden_layers=2,
                                               layer_types=["mamba", "attention"]))
              for family in ("granite-4-h", "granite-4-h-dense")}
IDS = jnp.asarray(np.random.RandomState(0).randint(1, 63, (2, 24)))  # 3 chunks of 8


def logits(cfg, params=None):
    apply_fn, own = split_model(LlamaForCausalLM(cfg, nnx.Rngs(0)))
    return np.asarray(jax.jit(apply_fn)(own if params is None else params(own), IDS))


def test_stacked_mamba2_layers_run_under_a_scan_as_unrolled():
    """``scan_layers``: the two Mamba2 layers are one stack (its conv and A_log stacked too)
    and the logits are the unrolled model's."""
    model = LlamaForCausalLM(dataclasses.replace(DENSE, scan_layers=True), nnx.Rngs(0))
    paths = [p for p, _ in named_leaves(nnx.state(model, nnx.Param))]
    assert "model/layers/0:2/mamba/conv1d/weight" in paths
    assert "model/layers/0:2/mamba/A_log" in paths
    apply_fn, params = split_model(model)
    unrolled = logits(dataclasses.replace(DENSE, scan_layers=False))
    np.testing.assert_allclose(np.asarray(jax.jit(apply_fn)(params, IDS)), unrolled, atol=1e-5)


def test_bf16_compute_stays_near_fp32():
    full = logits(DENSE)
    half = logits(DENSE, lambda p: jax.tree.map(lambda x: x.astype(jnp.bfloat16), p))
    assert np.abs(half.astype(np.float32) - full).max() < 0.05 * np.abs(full).max()
    assert (half.argmax(-1) == full.argmax(-1)).mean() > 0.8


def test_lora_adapts_the_mamba2_output_projection_and_trains_as_on_one_device():
    """Adapters on each Mamba2 layer's ``out_proj`` (and the attention and MLP projections);
    a LoRA update at mp 2 x dp 4 gives one device's adapters (1e-5)."""
    import optax

    from redco import Trainer
    from redco.lora import trainable_mask
    from redco_zoo_lm import collate_fn, loss_fn
    from redco_zoo_models.lora import add_lora, lora_layers
    rows = [{"token_ids": r} for r in np.random.RandomState(1).randint(1, 63, (4, 17))]

    def trained(**deployer):
        model = add_lora(LlamaForCausalLM(TWO_LAYERS["granite-4-h-dense"], nnx.Rngs(0)), rank=4)
        assert "model/layers/0/mamba/out_proj" in {path for path, _ in lora_layers(model)}
        apply_fn, params = split_model(model)
        trainer = Trainer(Deployer(jax_seed=0, workdir=None, verbose=False, **deployer),
                          collate_fn, apply_fn, loss_fn, params, optax.sgd(0.5),
                          trainable=trainable_mask(params))
        trainer.train_epoch(rows, 4 // trainer.deployer.dp_size, 0)
        return dict(named_leaves(jax.device_get(trainer.params)))

    one, many = trained(n_local_devices=1), trained(n_model_shards=2)
    adapted = [p for p in one if "mamba/out_proj/lora" in p]
    assert adapted and any(np.abs(one[p]).max() > 0 for p in adapted if p.endswith("lora_b"))
    for path in one:
        np.testing.assert_allclose(many[path], one[path], rtol=1e-5, atol=1e-5, err_msg=path)


def test_its_experts_split_over_dp_train_as_on_one_device():
    """Granite's MoE (beside Mamba2 layers, a shared MLP in each block) with its experts split
    over dp as ``--expert_parallel`` splits them (``for_trainer``), dp 4 x mp 2 ``auto+fsdp``,
    every layer rematerialised (``remat="full"``: Mamba2 and attention layers recomputed in the
    backward pass): an update gives one device's params without remat (1e-5)."""
    import optax

    from redco import Trainer
    from redco_zoo_lm import collate_fn, loss_fn
    from redco_zoo_models.expert_parallel import for_trainer
    rows = [{"token_ids": r} for r in np.random.RandomState(6).randint(1, 63, (4, 17))]

    def trained(split: bool, **deployer):
        deployer = Deployer(jax_seed=0, workdir=None, verbose=False, **deployer)
        apply_fn, params = split_model(LlamaForCausalLM(TWO_LAYERS["granite-4-h"], nnx.Rngs(0)))
        rules = for_trainer(params, deployer) if split else None
        trainer = Trainer(deployer, collate_fn, apply_fn, loss_fn, params, optax.sgd(0.5),
                          params_sharding_rules=rules, remat="full" if split else "none")
        trainer.train_epoch(rows, 4 // deployer.dp_size, 0)
        return trainer.params

    one = trained(False, n_local_devices=1)
    many = trained(True, n_model_shards=2, sharding_rules="auto+fsdp")
    experts, lead = first_layer_with(many["model"]["layers"], "mlp/experts")
    assert experts["gate_proj"].sharding.spec[len(lead)] == "dp"
    want = dict(named_leaves(jax.device_get(one)))
    for path, got in named_leaves(jax.device_get(many)):
        np.testing.assert_allclose(got, want[path], rtol=1e-5, atol=1e-5, err_msg=path)


@pytest.mark.parametrize("family", ["granite-4-h-dense", pytest.param("granite-4-h",
                                                                     marks=pytest.mark.slow),
                                    "falcon-h1", pytest.param("nemotron-h",
                                                              marks=pytest.mark.slow)])
def test_packed_documents_see_only_themselves(family):  # (Falcon-H1: attention and Mamba2 both)
    """Three documents in a row of 32 (12, 4 and 16 tokens: one ends inside a chunk of 8, one at
    a chunk's end, one spans two chunks): each one's logits are its own forward pass's. Granite
    4 with its MoE and NoPE attention and Nemotron-H (the same blocks, one a layer) run with
    REDCO_SLOW_TESTS=1: the same Mamba2 and attention masks as granite-4-h-dense's in CI
    (experts and MLPs read each token alone)."""
    cfg = LlamaConfig.from_hf(TINY_FAMILIES[family])
    apply_fn, params = split_model(LlamaForCausalLM(cfg, nnx.Rngs(0)))
    run = jax.jit(lambda ids, segments=None: apply_fn(params, ids, segment_ids=segments))
    ids = jnp.asarray(np.random.RandomState(2).randint(1, 63, (1, 32)))
    packed = np.asarray(run(ids, jnp.asarray([[1] * 12 + [2] * 4 + [3] * 16])))
    for start, stop in ((0, 12), (12, 16), (16, 32)):
        np.testing.assert_allclose(packed[:, start:stop], np.asarray(run(ids[:, start:stop])),
                                   atol=2e-5, err_msg=f"document {start}:{stop}")



def test_nemotron_hs_blocks_get_the_dataflow_plan_adapters_and_quantised_experts():
    """Nemotron-H (one block a layer: Mamba2, relu2 MLP, Mamba2, MLP, NoPE attention, MoE) under
    ``auto`` tensor parallelism at mp 2, planned off its traced dataflow (abstract params,
    nothing compiled): the ungated MLPs and the shared expert split column then row, the
    experts on their own width, Mamba2 and attention as Granite's. LoRA adapts the MLPs' and
    the shared expert's projections beside the mixers'; int8 experts (QLoRA) keep the two
    weights ungated experts have and trace to the logits' shape."""
    from redco.sharding import specs_from_rules
    from redco_zoo_models.lora import add_lora, lora_layers
    from redco_zoo_models.quantized_experts import quantize_experts
    cfg = dataclasses.replace(LlamaConfig.from_hf(TINY_FAMILIES["nemotron-h"]),
                              scan_layers=False)  # (its layers one by one)
    apply_fn, params = split_model(nnx.eval_shape(lambda: LlamaForCausalLM(cfg, nnx.Rngs(0))))
    deployer = Deployer(jax_seed=0, workdir=None, verbose=False, n_model_shards=2)
    rules = deployer.get_sharding_rules(params, trace_fn=lambda p: apply_fn(p, IDS))
    specs = {p: tuple(s) for p, s in named_leaves(specs_from_rules(params, rules,
                                                                    deployer.mesh))}
    column, row = (None, "mp"), ("mp", None)
    for mlp in ("layers/1/mlp", "layers/3/mlp", "layers/5/mlp/shared_experts"):
        assert (specs[f"model/{mlp}/up_proj/kernel"], specs[f"model/{mlp}/down_proj/kernel"]) \
            == (column, row), mlp
    assert specs["model/layers/5/mlp/experts/up_proj"] == (None, None, "mp")
    assert specs["model/layers/5/mlp/experts/down_proj"] == (None, "mp", None)
    assert (specs["model/layers/0/mamba/in_proj/kernel"],
            specs["model/layers/0/mamba/out_proj/kernel"]) == (column, row)
    assert specs["model/layers/4/self_attn/q_proj/kernel"] == column
    adapted = {p for p, _ in lora_layers(add_lora(LlamaForCausalLM(cfg, nnx.Rngs(0)), rank=4))}
    assert {"model/layers/1/mlp/up_proj", "model/layers/1/mlp/down_proj",
            "model/layers/5/mlp/shared_experts/up_proj", "model/layers/0/mamba/out_proj",
            "model/layers/4/self_attn/o_proj"} <= adapted
    model = LlamaForCausalLM(cfg, nnx.Rngs(0))
    assert quantize_experts(model, "int8") == ["model/layers/5/mlp/experts"]
    apply_fn, params = split_model(model)
    assert not any("gate_proj" in p for p, _ in named_leaves(params))
    assert jax.eval_shape(apply_fn, params, IDS).shape == (*IDS.shape, cfg.vocab_size)


def test_nemotron_hs_hub_layout_reads_as_transformers_5s():
    """A hub config.json of Nemotron-H (``hybrid_override_pattern``, one character a layer, and
    the older ``mamba_*`` names of the Mamba2 keys) reads as the layout transformers 5 writes
    (``layers_block_type``): the same layers, experts and Mamba2 shape."""
    new = dict(TINY_FAMILIES["nemotron-h"], n_groups=2, conv_kernel=4, chunk_size=8)
    hub = {k: v for k, v in new.items()
           if k not in ("layers_block_type", "n_groups", "conv_kernel", "chunk_size")}
    hub.update(hybrid_override_pattern="M-M-*E", mamba_n_groups=2, mamba_d_conv=4,
               mamba_chunk_size=8)
    assert LlamaConfig.from_hf(hub) == LlamaConfig.from_hf(new)
    cfg = LlamaConfig.from_hf(hub)
    assert [cfg.sparse(i) for i in range(6)] == [False] * 5 + [True]
    assert [cfg.has_mlp(i) for i in range(6)] == [False, True, False, True, False, True]
