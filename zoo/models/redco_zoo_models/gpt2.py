"""GPT-2 in Flax NNX, optionally with cross-attention (the decoder of a VisionEncoderDecoder).

Module names follow HuggingFace's GPT-2 (``transformer/h/0/attn/c_attn/weight``). Like
HuggingFace's ``Conv1D``, the projections keep ``weight`` as (in, out); ``lm_head`` is tied to
``transformer.wte`` unless ``tie_word_embeddings`` is off.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from redco import remat
from redco_zoo_models.attention import attend, init_cache
from redco_zoo_models.chunked_loss import next_token_loss
from redco_zoo_models.context_parallel import (
    SplitSequence,
    cached_keys,
    decoder_layout,
    in_order,
    on_split,
)
from redco_zoo_models.layers import ACTIVATIONS, embed


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None  # 4 * n_embd
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    add_cross_attention: bool = False
    tie_word_embeddings: bool = True
    bos_token_id: int | None = 50256
    eos_token_id: int | None = 50256

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def from_hf(cls, config: dict) -> "GPT2Config":
        """From a HuggingFace GPT-2 ``config.json`` (its defaults where a key is missing)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: tuple(v) if isinstance(v, list) else v  # (a list of eos ids)
                      for k, v in config.items() if k in fields})

    def to_hf(self) -> dict:
        return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                "is_decoder": self.add_cross_attention, **dataclasses.asdict(self)}


class Conv1D(nnx.Module):
    """HuggingFace's GPT-2 projection: ``x @ weight + bias`` with ``weight`` (in, out)."""

    def __init__(self, n_in: int, n_out: int, rngs: nnx.Rngs):
        self.weight = nnx.Param(0.02 * jax.random.normal(rngs.params(), (n_in, n_out)))
        self.bias = nnx.Param(jnp.zeros((n_out,)))

    def __call__(self, x):
        return x @ self.weight[...] + self.bias[...]


class Attention(nnx.Module):
    """Causal self-attention (``c_attn`` gives q, k, v) or cross-attention (``q_attn`` gives q
    from the decoder, ``c_attn`` k and v from the encoder's ``context``)."""

    def __init__(self, cfg: GPT2Config, layer_idx: int, rngs: nnx.Rngs, cross: bool = False):
        d = cfg.n_embd
        if cross:
            self.q_attn = Conv1D(d, d, rngs)
        self.c_attn = Conv1D(d, (2 if cross else 3) * d, rngs)
        self.c_proj = Conv1D(d, d, rngs)
        self.n_head = cfg.n_head
        self.scale = cfg.head_dim ** -0.5 if cfg.scale_attn_weights else 1.0
        if cfg.scale_attn_by_inverse_layer_idx:
            self.scale /= layer_idx + 1

    def __call__(self, x, allowed=None, layer_cache=None, cache_index=0, context=None):
        if context is None:
            q, k, v = jnp.split(self.c_attn(x), 3, -1)
        else:
            q, (k, v) = self.q_attn(x), jnp.split(self.c_attn(context), 2, -1)
        q, k, v = (y.reshape(*y.shape[:2], self.n_head, -1) for y in (q, k, v))
        k, v, layer_cache = cached_keys(layer_cache, k, v, cache_index, allowed)
        out = allowed.attend(q, k, v, self.scale) if isinstance(allowed, SplitSequence) else \
            attend(q, k, v, allowed, scale=self.scale, is_causal=context is None and allowed is None)
        return self.c_proj(out.reshape(*x.shape[:2], -1)), layer_cache


class MLP(nnx.Module):
    def __init__(self, cfg: GPT2Config, rngs: nnx.Rngs):
        inner = cfg.n_inner or 4 * cfg.n_embd
        self.c_fc, self.c_proj = Conv1D(cfg.n_embd, inner, rngs), Conv1D(inner, cfg.n_embd, rngs)
        self.activation = cfg.activation_function

    def __call__(self, x):
        return self.c_proj(ACTIVATIONS[self.activation](self.c_fc(x)))


class Block(nnx.Module):
    def __init__(self, cfg: GPT2Config, layer_idx: int, rngs: nnx.Rngs):
        norm = lambda: nnx.LayerNorm(cfg.n_embd, epsilon=cfg.layer_norm_epsilon, rngs=rngs)
        self.ln_1, self.attn = norm(), Attention(cfg, layer_idx, rngs)
        if cfg.add_cross_attention:
            self.ln_cross_attn = norm()
            self.crossattention = Attention(cfg, layer_idx, rngs, cross=True)
        self.ln_2, self.mlp = norm(), MLP(cfg, rngs)

    @remat.layer
    def __call__(self, x, allowed, layer_cache=None, cache_index=0, context=None):
        h, layer_cache = self.attn(self.ln_1(x), allowed, layer_cache, cache_index)
        x = x + h
        if context is not None:
            x = x + self.crossattention(self.ln_cross_attn(x), context=context)[0]
        return x + self.mlp(self.ln_2(x)), layer_cache


class GPT2Model(nnx.Module):
    """The decoder stack, named as HuggingFace names it (``transformer.h.0.attn...``)."""

    def __init__(self, cfg: GPT2Config, rngs: nnx.Rngs):
        self.wte = nnx.Embed(cfg.vocab_size, cfg.n_embd, rngs=rngs)
        self.wpe = nnx.Embed(cfg.n_positions, cfg.n_embd, rngs=rngs)
        self.h = nnx.List([Block(cfg, i, rngs) for i in range(cfg.n_layer)])
        self.ln_f = nnx.LayerNorm(cfg.n_embd, epsilon=cfg.layer_norm_epsilon, rngs=rngs)

    def __call__(self, input_ids, attention_mask=None, cache=None, cache_index=0,
                 encoder_hidden_states=None, segment_ids=None):
        input_ids, positions, allowed = decoder_layout(  # (a split sequence: context parallel)
            input_ids, attention_mask, cache is not None, cache_index, segment_ids)
        if isinstance(allowed, SplitSequence) and encoder_hidden_states is not None:
            raise ValueError("Context parallelism splits a decoder's own causal sequence; this "
                             "decoder also attends to an encoder (cross-attention), which it "
                             "cannot serve: set n_context_shards=1.")
        x = on_split(embed(self.wte, input_ids) + embed(self.wpe, positions), allowed)
        new_cache = []
        for i, block in enumerate(self.h):
            x, layer_cache = block(x, allowed, cache and cache[i], cache_index,
                                   encoder_hidden_states)
            new_cache.append(layer_cache)
        return in_order(self.ln_f(x), allowed), (new_cache if cache is not None else None)


class GPT2LMHeadModel(nnx.Module):
    config_class = GPT2Config
    base_model_prefix = "transformer"  # hf.from_pretrained also reads GPT2Model's checkpoints

    def __init__(self, cfg: GPT2Config, rngs: nnx.Rngs):
        self.cfg = cfg
        self.transformer = GPT2Model(cfg, rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Linear(cfg.n_embd, cfg.vocab_size, use_bias=False, rngs=rngs)

    def __call__(self, input_ids, attention_mask=None, cache=None, cache_index=0,
                 encoder_hidden_states=None, segment_ids=None, labels=None, label_mask=None,
                 return_metrics=False):
        """Logits ``(B, T, vocab)`` for token ids ``(B, T)``; with a ``cache`` (``init_cache``),
        ``(logits, cache)``. ``attention_mask`` marks real tokens (1) and padding (0) over the
        input, or with a cache over all of its slots; ``segment_ids`` (B, T) pack documents into
        rows, none seeing another (see ``redco_zoo_models.attention``).
        ``encoder_hidden_states`` (B, S, n_embd) feed the cross-attention. Given ``labels``
        (B, T), the mean cross-entropy of predicting them (where ``label_mask``) instead, a
        chunk of tokens at a time (``redco_zoo_models.chunked_loss``). With
        ``return_metrics``, ``(that, {})``, as the decoders return theirs (GPT-2 has none)."""
        out = self._outputs(input_ids, attention_mask, cache, cache_index, encoder_hidden_states,
                            segment_ids, labels, label_mask)
        return (out, {}) if return_metrics else out

    def _outputs(self, input_ids, attention_mask, cache, cache_index, encoder_hidden_states,
                 segment_ids, labels, label_mask):
        x, cache = self.transformer(input_ids, attention_mask, cache, cache_index,
                                    encoder_hidden_states, segment_ids)
        if labels is not None:
            head = self.transformer.wte.embedding[...].T if self.cfg.tie_word_embeddings \
                else self.lm_head.kernel[...]
            return next_token_loss(x, head, labels, label_mask)
        if self.cfg.tie_word_embeddings:
            logits = x @ self.transformer.wte.embedding[...].T
        else:
            logits = self.lm_head(x)
        return logits if cache is None else (logits, cache)

    def decode(self, ids, key_valid, cache, cache_index, context=None):
        """One generation step (``redco_zoo_models.generation``); ``context``: encoder states."""
        return self(ids, key_valid, cache, cache_index, encoder_hidden_states=context)

    def init_cache(self, batch: int, n_slots: int, dtype=jnp.float32) -> list[dict]:
        cfg = self.cfg
        return init_cache(cfg.n_layer, batch, n_slots, cfg.n_head, cfg.head_dim, dtype)
