"""HuggingFace-4.x Flax architectures (transformers 4.57.6), tiny and random, behind one API.

``build(arch)`` gives an :class:`HFModel`: its config, params, ``apply_fn(params, batch)`` (the
model's main output), ``loss_fn(params, batch)`` (an fp32 scalar that depends on every param
the model uses) and deterministic batches. ``build(arch, abstract=True, **config_overrides)``
gives the params as ``jax.ShapeDtypeStruct`` only (nothing allocated: fine for 66B configs).

Nothing is downloaded: every model is built from a config with random weights. BART and mBART
add `final_logits_bias` under `stop_gradient` (a buffer): its gradient is zero by design.
"""
from __future__ import annotations

import functools
import types
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import transformers
from flax.core import unfreeze
from transformers.models.t5 import modeling_flax_t5

from redco import hookimpl

# ---- jax 0.10 compatibility ---------------------------------------------------------------
# Flax T5 (transformers 4.57.6) calls ``jnp.clip(x, a_max=...)``; jax >= 0.10 removed the
# ``a_min``/``a_max`` keywords (now ``min``/``max``). Give that one module a ``jnp`` whose
# ``clip`` accepts both spellings; jax.numpy itself is left alone.


def _clip(x, min=None, max=None, *, a_min=None, a_max=None):  # noqa: A002 (jnp's own names)
    return jnp.clip(x, min if a_min is None else a_min, max if a_max is None else a_max)


_t5_jnp = types.ModuleType("jax.numpy (a_min/a_max clip shim)")
_t5_jnp.__dict__.update(jnp.__dict__)
_t5_jnp.clip = _clip
modeling_flax_t5.jnp = _t5_jnp

ARCHS = ["gpt2", "gptj", "gpt_neo", "opt", "llama", "mistral", "bart", "mbart", "vit", "bert",
         "roberta", "t5"]
IMAGE_SIZE, VOCAB = 32, 128
CAUSAL = {"gpt2", "gptj", "gpt_neo", "opt", "llama", "mistral"}
SEQ2SEQ = {"bart", "mbart", "t5"}


def _configs(seq_len: int) -> dict[str, tuple[type, type, dict]]:
    """arch -> (config class, Flax model class, tiny config fields)."""
    t, pos = transformers, max(seq_len, 64)  # Flax LLaMA/Mistral need >= 2 x head_dim positions
    dec = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=128, max_position_embeddings=pos)
    bart = dict(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2,
                encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                decoder_ffn_dim=128, max_position_embeddings=pos)
    return {
        "gpt2": (t.GPT2Config, t.FlaxGPT2LMHeadModel,
                 dict(vocab_size=VOCAB, n_positions=pos, n_embd=64, n_layer=2,
                      n_head=4, n_inner=128)),
        "gptj": (t.GPTJConfig, t.FlaxGPTJForCausalLM,
                 dict(vocab_size=VOCAB, n_positions=pos, n_embd=64, n_layer=2,
                      n_head=4, n_inner=128, rotary_dim=8)),
        "gpt_neo": (t.GPTNeoConfig, t.FlaxGPTNeoForCausalLM,
                    dict(vocab_size=VOCAB, max_position_embeddings=pos,
                         hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
                         attention_types=[[["global", "local"], 1]], window_size=8)),
        "opt": (t.OPTConfig, t.FlaxOPTForCausalLM,
                dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, ffn_dim=128,
                     num_attention_heads=4, word_embed_proj_dim=64,
                     max_position_embeddings=pos)),
        "llama": (t.LlamaConfig, t.FlaxLlamaForCausalLM, dict(dec, num_key_value_heads=2)),
        "mistral": (t.MistralConfig, t.FlaxMistralForCausalLM,
                    dict(dec, num_key_value_heads=2, sliding_window=8)),
        "bart": (t.BartConfig, t.FlaxBartForConditionalGeneration, bart),
        "mbart": (t.MBartConfig, t.FlaxMBartForConditionalGeneration, bart),
        "vit": (t.ViTConfig, t.FlaxViTForImageClassification,
                dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, image_size=IMAGE_SIZE, patch_size=8, num_channels=3,
                     num_labels=16)),
        "bert": (t.BertConfig, t.FlaxBertForMaskedLM, dict(dec, type_vocab_size=2)),
        "roberta": (t.RobertaConfig, t.FlaxRobertaForMaskedLM,
                    dict(dec, max_position_embeddings=pos + 2, pad_token_id=1)),
        "t5": (t.T5Config, t.FlaxT5ForConditionalGeneration,
               dict(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                    num_heads=4, feed_forward_proj="gated-gelu", tie_word_embeddings=True,
                    relative_attention_num_buckets=8, decoder_start_token_id=0)),
    }


@dataclass
class HFModel:
    name: str
    config: Any  # the transformers config
    params: Any  # nested dict of arrays (jax.ShapeDtypeStruct when abstract=True)
    apply_fn: Callable  # apply_fn(params, batch) -> logits / last hidden state
    loss_fn: Callable  # loss_fn(params, batch) -> fp32 scalar
    batch: Callable[[int], dict]  # batch(rows) -> dict of numpy arrays, deterministic
    abstract_batch: Callable[[int], dict]  # the same as jax.ShapeDtypeStruct


def _cross_entropy(logits, labels):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def _make_batch(arch: str, config, seq_len: int, rows: int) -> dict:
    rng = np.random.default_rng(0)
    if arch == "vit":
        size, channels = config.image_size, config.num_channels
        return {"pixel_values": rng.normal(size=(rows, channels, size, size)).astype(np.float32),
                "labels": rng.integers(0, config.num_labels, rows).astype(np.int32)}
    ids = lambda: rng.integers(3, config.vocab_size, (rows, seq_len)).astype(np.int32)
    if arch in SEQ2SEQ:
        labels = ids()
        first = config.decoder_start_token_id
        start = np.full((rows, 1), config.eos_token_id if first is None else first, np.int32)
        return {"input_ids": ids(), "decoder_input_ids": np.concatenate(
            [start, labels[:, :-1]], axis=1), "labels": labels}
    return {"input_ids": ids()}


def build(arch: str, abstract: bool = False, seq_len: int = 16, **config_overrides) -> HFModel:
    config_cls, model_cls, fields = _configs(seq_len)[arch]
    config = config_cls(**{**fields, **config_overrides})
    for name in ("dropout", "attention_dropout", "activation_dropout", "hidden_dropout_prob",
                 "attention_probs_dropout_prob", "resid_pdrop", "embd_pdrop", "attn_pdrop",
                 "dropout_rate", "embed_dropout", "classifier_dropout"):
        if hasattr(config, name):
            setattr(config, name, 0.0)
    if abstract:
        model = model_cls(config, _do_init=False)
        params = jax.eval_shape(functools.partial(model.init_weights,
                                                  input_shape=model.input_shape),
                                jax.random.PRNGKey(0))
    else:
        model = model_cls(config, seed=0)
        params = model.params
    params = unfreeze(params)  # plain nested dicts

    def apply_fn(params, batch):
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        return model(**inputs, params=params)[0]  # every model's default is deterministic

    def loss_fn(params, batch):
        out = apply_fn(params, batch)
        if arch in CAUSAL:
            return _cross_entropy(out[:, :-1], batch["input_ids"][:, 1:])
        if arch in SEQ2SEQ or arch == "vit":
            return _cross_entropy(out, batch["labels"])
        return _cross_entropy(out, batch["input_ids"])  # masked LM, nothing masked

    def batch(rows: int) -> dict:
        return _make_batch(arch, config, seq_len, rows)

    def abstract_batch(rows: int) -> dict:
        return {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch(rows).items()}

    return HFModel(arch, config, params, apply_fn, loss_fn, batch, abstract_batch)


class LossRecorder:
    """A Trainer callback (a redco plugin, hooks only) that keeps every step's loss."""

    def __init__(self):
        self.losses = []

    @hookimpl
    def on_step_end(self, trainer, step, metrics):
        self.losses.append(float(metrics["loss"]))
