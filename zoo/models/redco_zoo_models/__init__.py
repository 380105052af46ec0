"""Flax NNX models for the Redco zoo."""
from redco_zoo_models.llama import LLAMA_PRESETS, LlamaConfig, LlamaForCausalLM, generate
from redco_zoo_models.nnx_utils import split_model

__all__ = ["LLAMA_PRESETS", "LlamaConfig", "LlamaForCausalLM", "generate", "split_model"]
