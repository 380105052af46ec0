"""Pieces several zoo models share: HuggingFace's activation names, and RMSNorm."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

ACTIVATIONS = {
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "relu": jax.nn.relu, "silu": jax.nn.silu, "swish": jax.nn.silu, "tanh": jnp.tanh,
}


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float):
        self.weight = nnx.Param(jnp.ones((dim,)))
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 ** 2, axis=-1, keepdims=True) + self.eps)
        return (x32 * self.weight[...]).astype(x.dtype)
