"""The planner's LoRA lever (opt-in, ``lora_rank``): tried only once every full fine-tuning
layout failed; measured by the same ahead-of-time compile, the base frozen."""
import jax
import jax.numpy as jnp
import pytest

from redco_planner.inspection import load_model
from redco_planner.layouts import usable_bytes
from redco_planner.measure import measure
from redco_planner.models import lm_loss
from redco_planner.planner import PlanError, plan


@pytest.fixture(scope="module")
def tiny():
    return load_model("llama-tiny", seq_len=32)


def test_lora_only_after_every_full_fine_tuning_layout_fails(tiny):
    batch = tiny.batch(1)
    roomy = plan(tiny.params, tiny.loss_fn, batch, 1, 2 ** 40, rule_sets=("auto",),
                 lora_rank=8, lora=tiny.lora)
    assert [t.lora_rank for t in roomy.tried] == [None] and roomy.lora_rank is None
    full = roomy.tried[0]
    tight = plan(tiny.params, tiny.loss_fn, batch, 1, full.peak_bytes, rule_sets=("auto",),
                 lora_rank=8, lora=tiny.lora)
    assert [(t.lora_rank, t.fits) for t in tight.tried] == [(None, False), (8, True)]
    assert tight.lora_rank == 8 and "native LoRALinear" in tight.lora_via
    assert "no full fine-tuning layout fits; with LoRA rank 8" in tight.reason
    lora = tight.tried[1]
    adapter_bytes = lora.params_bytes - full.params_bytes
    assert adapter_bytes > 0
    # Adam's mu and nu for the adapters alone (a step count and the batch) beside the params: the
    # frozen base has no optimizer state, and no gradient
    assert 2 * adapter_bytes <= lora.argument_bytes - lora.params_bytes <= 2 * adapter_bytes + 1024
    assert lora.peak_bytes < full.peak_bytes - 1.5 * full.params_bytes


def test_lora_by_default_adds_core_adapters_to_any_params():
    params = {"layer": {"q_proj": {"kernel": jnp.zeros((128, 128))}}}

    def loss(p, batch):
        return jnp.mean((batch["x"] @ p["layer"]["q_proj"]["kernel"]) ** 2)
    batch = {"x": jax.ShapeDtypeStruct((2, 128), jnp.float32)}
    full = plan(params, loss, batch, 1, 2 ** 30, rule_sets=("auto",)).peak_bytes
    tight = plan(params, loss, batch, 1, full, rule_sets=("auto",), lora_rank=4)
    assert tight.lora_rank == 4 and "redco.lora.add_adapters" in tight.lora_via
    assert tight.peak_bytes < 0.6 * full  # params and the merged kernel; no mu, nu, gradient
    with pytest.raises(PlanError, match="No layout fits"):
        plan(params, loss, batch, 1, 1000, rule_sets=("auto",))  # no lora_rank: no LoRA


def test_auto_layout_of_a_lora_trainer_counts_no_optimizer_state_for_the_base(workdir):
    """``Trainer(trainable=mask)`` under ``n_model_shards="auto"``: the planner measures the
    step the Trainer runs (adapters differentiated, the base frozen), so a memory that fits
    LoRA on one device, and not full fine-tuning of the same params, keeps mp=1, ``auto`` rules
    (no FSDP) and no remat."""
    import optax
    from flax import nnx
    from planner_helpers import lm_examples

    from redco import Deployer, Trainer, lora
    from redco_zoo_lm import collate_fn, loss_fn
    from redco_zoo_models import LlamaConfig, LlamaForCausalLM, add_lora, split_model
    cfg = LlamaConfig(vocab_size=32, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    add_lora(model, rank=4)
    apply_fn, params = split_model(model)
    mask = lora.trainable_mask(params)
    batch = {"input_ids": jax.ShapeDtypeStruct((1, 9), jnp.int32)}
    adapters_only = measure(params, lm_loss(apply_fn), batch, 8, 1, "auto", trainable=mask)
    everything = measure(params, lm_loss(apply_fn), batch, 8, 1, "auto")
    memory = int(adapters_only.peak_bytes / 0.9) + 1
    assert everything.peak_bytes > usable_bytes(memory)  # full Adam state would not fit
    deployer = Deployer(jax_seed=0, n_model_shards="auto", device_memory=memory, workdir=workdir,
                        verbose=False)
    trainer = Trainer(deployer, collate_fn, apply_fn, loss_fn, params, optax.adamw(1e-2),
                      trainable=mask)
    trainer.fit(lm_examples(8, seq_len=8), per_device_batch_size=1, n_epochs=1)
    layout = deployer.layout
    assert (layout.n_model_shards, layout.sharding_rules, layout.remat) == (1, "auto", "none")
    assert deployer.layout_plan.tried[0].peak_bytes == adapters_only.peak_bytes
    assert trainer.step == 1
