"""The LLaMA family's names for the zoo's shared decoder (``redco_zoo_models.decoder``), and
published LLaMA shapes.

``LlamaConfig`` and ``LlamaForCausalLM`` are the decoder's config and causal LM: one class reads
every family in ``redco_zoo_models.families`` (LLaMA 1-3, Mistral, Qwen2/3, Gemma 2/3, Phi-3/4,
OLMo 2), its ``family`` field saying which.
"""
from __future__ import annotations

from redco_zoo_models.decoder import DecoderConfig, DecoderLM

LlamaConfig = DecoderConfig
LlamaForCausalLM = DecoderLM


def _shape(hidden: int, ffn: int, layers: int, heads: int, kv_heads: int | None = None) -> dict:
    return dict(vocab_size=32000, hidden_size=hidden, intermediate_size=ffn,
                num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv_heads or heads)


LLAMA_PRESETS = {  # published shapes, as LlamaConfig fields
    "llama-1b": _shape(2048, 5632, 22, 32, 4),  # TinyLlama-1.1B
    "llama-7b": _shape(4096, 11008, 32, 32),
    "llama-13b": _shape(5120, 13824, 40, 40),
    "llama-30b": _shape(6656, 17920, 60, 52),
    "llama-65b": _shape(8192, 22016, 80, 64),
}
