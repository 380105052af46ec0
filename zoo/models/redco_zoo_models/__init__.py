"""Flax NNX models for the Redco zoo."""
from redco_zoo_models.llama import LlamaConfig, LlamaForCausalLM, generate
from redco_zoo_models.nnx_utils import split_model

__all__ = ["LlamaConfig", "LlamaForCausalLM", "generate", "split_model"]
