"""The FLOPs MFU is computed from, counted in the step's jaxpr: they match XLA's own count of the
lowered step (on a CPU, where jax offers it), and cuDNN's fused attention counts as XLA counts
the same attention unfused.

cuDNN attention is traced here on a CPU: jax checks for cuDNN and the GPU generation while
tracing, so those two checks are answered as a GPU would. Nothing is lowered for or run on a GPU;
the jaxpr is the one a GPU traces."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import lm_collate, lm_loss
from jax._src.cudnn import fused_attention_stablehlo

import redco
from redco import Deployer, Trainer
from redco.step_flops import jaxpr_flops, step_flops
from redco_zoo_models import LlamaConfig, LlamaForCausalLM, add_lora, split_model

B, T, S, N, KV, D = 2, 64, 48, 4, 2, 128


@pytest.fixture
def cudnn_traceable(monkeypatch):
    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda *a, **k: 91000)
    monkeypatch.setattr(fused_attention_stablehlo, "check_compute_capability",
                        lambda *a, **k: True)


def attention_grads(implementation: str, n_layers: int = 1):
    """The gradient of a causal GQA attention stacked ``n_layers`` times in a scan."""
    def loss(q, k, v):
        def layer(q, _):
            return jax.nn.dot_product_attention(q, k, v, is_causal=False,
                                                implementation=implementation), None
        return jax.lax.scan(layer, q, length=n_layers)[0].astype(jnp.float32).sum()
    q = jax.ShapeDtypeStruct((B, T, N, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, S, KV, D), jnp.bfloat16)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv)


def test_fused_attention_counts_what_xla_counts_for_the_same_attention_unfused(cudnn_traceable):
    fused = step_flops(attention_grads("cudnn"))
    assert fused == 3 * 2 * B * N * T * S * (D + D)  # forward once, backward twice
    unfused = attention_grads("xla").lower().cost_analysis()["flops"]  # XLA's own count
    assert unfused == pytest.approx(fused, rel=0.03), (
        "the fused attention's count should match XLA's count of the same attention unfused "
        "(dots; the softmax adds under 3%)")


def test_a_scanned_fused_attention_counts_once_per_iteration(cudnn_traceable):
    one = jaxpr_flops(attention_grads("cudnn").jaxpr)
    assert jaxpr_flops(attention_grads("cudnn", n_layers=3).jaxpr) == 3 * one


# Each case compiles its own step. In CI the plain step and the one with remat, LoRA and
# micro-batches all together (a miscount of any of the three shows there); each alone is slow.
SLOW = pytest.mark.slow


@pytest.mark.parametrize("remat, lora, micro_batches", [
    ("none", False, 1), pytest.param("full", False, 1, marks=SLOW),
    pytest.param("none", True, 1, marks=SLOW), pytest.param("none", False, 2, marks=SLOW),
    ("full", True, 2)])
def test_a_train_step_counts_what_xla_counts(tmp_path, remat, lora, micro_batches):
    """The single-feature cases are slow: the CI case full-True-2 guards each of them."""
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=704,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         scan_layers=False)  # (XLA counts a scanned stack's body once)
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    if lora:
        add_lora(model, rank=8)
    apply_fn, params = split_model(model)
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=str(tmp_path), verbose=False)
    trainer = Trainer(deployer, lm_collate, apply_fn, lm_loss, params, optax.adamw(1e-3),
                      remat=remat, accumulate_grad_batches=micro_batches,
                      trainable=redco.lora.trainable_mask(params) if lora else None)
    examples = [{"token_ids": np.arange(65) % 512} for _ in range(16 * micro_batches)]
    trainer.fit(examples, per_device_batch_size=4, n_epochs=1)
    xla = trainer.lower_train_step(examples, 4).cost_analysis()["flops"] * micro_batches
    assert trainer.step_flops() == pytest.approx(xla, rel=0.02)  # (XLA counts a loop once)
