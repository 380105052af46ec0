"""Pieces several zoo models share: HuggingFace's activation names, the gated linear unit, RMSNorm,
the gated MLP and the embedding lookup."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from redco import remat

ACTIVATIONS = {
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),  # (CLIP's)
    "relu2": lambda x: jnp.square(jax.nn.relu(x)),  # (Nemotron-H's: relu squared)
    "relu": jax.nn.relu, "silu": jax.nn.silu, "swish": jax.nn.silu, "tanh": jnp.tanh,
}


def glu(gate, up, act: str, limit: float | None = None, alpha: float = 1.702):
    """The gated linear unit of a gated MLP: ``act(gate) * up``. With a ``limit``, gpt-oss's
    clamped SwiGLU instead (``act`` unused): the gate clamped above at ``limit``, ``up`` to
    ``[-limit, limit]``, then ``gate * sigmoid(alpha * gate) * (up + 1)``."""
    if limit is None:
        return ACTIVATIONS[act](gate) * up
    gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return gate * jax.nn.sigmoid(alpha * gate) * (up + 1)


class RMSNorm(nnx.Module):
    """``x / rms(x) * (offset + weight)`` over the last axis, in float32. ``offset`` 1 is Gemma's
    norm, whose stored weight starts at 0."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        self.weight = nnx.Param(jnp.full((dim,), 1.0 - offset, jnp.float32))  # (not weak-typed)
        self.eps, self.offset = eps, offset

    def __call__(self, x):
        x32 = rms_normalized(x.astype(jnp.float32), self.eps)
        return (x32 * (self.offset + self.weight[...].astype(jnp.float32))).astype(x.dtype)


def rms_normalized(x, eps: float):
    """``x / sqrt(mean(x ** 2) + eps)`` over the last axis, without weights (Llama 4's q/k
    L2 norm; ``RMSNorm`` scales it)."""
    return x * jax.lax.rsqrt(jnp.mean(x ** 2, axis=-1, keepdims=True) + eps)


class GatedMLP(nnx.Module):
    """``down(act(gate(x)) * up(x))``, without biases (with them: ``bias``, Qwen2.5-VL's vision
    tower): the MLP of LLaMA-style decoders and an MoE block's shared experts, named as
    HuggingFace names it (``gate_proj``, ``up_proj``, ``down_proj``). ``multipliers``
    (Falcon-H1's ``mlp_multipliers``): the gate projection's and the output's scales."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, rngs: nnx.Rngs,
                 bias: bool = False, multipliers: tuple[float, float] = (1.0, 1.0)):
        linear = lambda i, o: nnx.Linear(i, o, use_bias=bias, rngs=rngs)  # noqa: E731
        self.gate_proj = linear(hidden_size, intermediate_size)
        self.up_proj = linear(hidden_size, intermediate_size)
        self.down_proj = linear(intermediate_size, hidden_size)
        self.act, self.multipliers = act, tuple(multipliers)

    def __call__(self, x):
        if self.multipliers == (1.0, 1.0):
            return self.down_proj(ACTIVATIONS[self.act](self.gate_proj(x)) * self.up_proj(x))
        gate, down = (jnp.asarray(m, x.dtype) for m in self.multipliers)
        return self.down_proj(ACTIVATIONS[self.act](self.gate_proj(x) * gate)
                              * self.up_proj(x)) * down


class MLP(nnx.Module):
    """``down(act(up(x)))``: the ungated MLP of Nemotron-H (``relu2``) and its MoE blocks'
    shared expert, named as HuggingFace names it (``up_proj``, ``down_proj``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, rngs: nnx.Rngs,
                 bias: bool = False):
        self.up_proj = nnx.Linear(hidden_size, intermediate_size, use_bias=bias, rngs=rngs)
        self.down_proj = nnx.Linear(intermediate_size, hidden_size, use_bias=bias, rngs=rngs)
        self.act = act

    def __call__(self, x):
        return self.down_proj(ACTIVATIONS[self.act](self.up_proj(x)))


@remat.layer
def embed(table: nnx.Embed, ids):
    """Rows ``ids`` of ``table``'s embedding, in the params' dtype (``nnx.Embed``'s own call
    fixes the dtype at init). A layer (``redco.remat.layer``), so under FSDP the table is
    gathered here and each device looks up its own rows. Left to XLA, a table split over the
    devices that split the batch laid the lookup's output out split over the hidden size, and
    every device then ran the forward pass over the whole global batch (zoo LLaMA, width 512,
    4 layers, 256 tokens a device, ``auto+fsdp``, full remat: 32.6 GFLOPs per device on 2
    devices, 63.3 on 8)."""
    return jnp.take(table.embedding[...], ids, axis=0)


def document_runs(segment_ids):
    """Packed rows' documents (B, T) as run numbers: equal exactly for neighbouring tokens of
    one document (a segment id met again later starts a new run)."""
    starts = jnp.concatenate([jnp.zeros_like(segment_ids[:, :1]),
                              (segment_ids[:, 1:] != segment_ids[:, :-1]).astype(
                                  segment_ids.dtype)], 1)
    return jnp.cumsum(starts, 1)


def last_real_inputs(x, history, n: int, valid=None):
    """The last ``n`` inputs (B, n, C) of a causal convolution over ``x`` (B, T, C) after
    ``history`` (B, n, C; ``None``: zeros): what the next token's window reads before its own.
    With ``valid`` (B, T), each row's window ends at its last real token, so right padding is
    never read (a row with no real token keeps ``history``)."""
    if history is None:
        history = jnp.zeros((x.shape[0], n, x.shape[2]), x.dtype)
    full = jnp.concatenate([history.astype(x.dtype), x], 1)
    if valid is None:
        return full[:, full.shape[1] - n:]
    end = jnp.max(jnp.where(valid, jnp.arange(1, x.shape[1] + 1), 0), axis=1)
    return jnp.take_along_axis(full, (end[:, None] + jnp.arange(n))[..., None], 1)
