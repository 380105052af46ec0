"""The FLOPs MFU is computed from count cuDNN's fused attention as XLA counts the same attention
unfused (XLA's cost analysis sees the fused kernel as a custom call and counts nothing).

cuDNN attention is traced here on a CPU: jax checks for cuDNN and the GPU generation while
tracing, so those two checks are answered as a GPU would. Nothing is lowered for or run on a GPU;
the jaxpr is the one a GPU traces."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax._src.cudnn import fused_attention_stablehlo

from redco.step_flops import fused_attention_flops, step_flops

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
    fused = fused_attention_flops(attention_grads("cudnn").jaxpr)
    assert fused == 3 * 2 * B * N * T * S * (D + D)  # forward once, backward twice
    unfused = step_flops(attention_grads("xla"))  # lowered and counted by XLA itself
    assert unfused == pytest.approx(fused, rel=0.03), (
        "the fused attention's count should match XLA's count of the same attention unfused "
        "(dots; the softmax adds under 3%)")


def test_a_scanned_fused_attention_counts_once_per_iteration(cudnn_traceable):
    one = fused_attention_flops(attention_grads("cudnn").jaxpr)
    assert fused_attention_flops(attention_grads("cudnn", n_layers=3).jaxpr) == 3 * one


def test_a_step_without_fused_attention_is_xla_s_count_alone():
    traced = attention_grads("xla")
    assert fused_attention_flops(traced.jaxpr) == 0
    assert step_flops(traced) == traced.lower().cost_analysis()["flops"]
