"""The planner's LoRA lever (opt-in, ``lora_rank``): tried only once every full fine-tuning
layout failed; measured by the same ahead-of-time compile, the base frozen."""
import jax
import jax.numpy as jnp
import pytest

from redco_planner.inspection import load_model
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
    with pytest.raises(PlanError, match="smallest per-device peak"):
        plan(params, loss, batch, 1, 1000, rule_sets=("auto",))  # no lora_rank: no LoRA
