"""Flax NNX models for the Redco zoo, named as HuggingFace names them."""
from redco_zoo_models.generation import generate
from redco_zoo_models.hf import from_pretrained, save_pretrained
from redco_zoo_models.llama import LLAMA_PRESETS, LlamaConfig, LlamaForCausalLM
from redco_zoo_models.nnx_utils import split_model

__all__ = ["LLAMA_PRESETS", "LlamaConfig", "LlamaForCausalLM", "from_pretrained", "generate",
           "save_pretrained", "split_model"]
