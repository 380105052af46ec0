"""Flax NNX models for the Redco zoo, named as HuggingFace names them, so that
``from_pretrained``/``save_pretrained`` read and write HuggingFace checkpoints."""
from redco_zoo_models.balancing import moe_optimizer
from redco_zoo_models.gemma3_vision import Gemma3ForConditionalGeneration, Gemma3VisionConfig
from redco_zoo_models.generation import generate
from redco_zoo_models.gpt2 import GPT2Config, GPT2LMHeadModel
from redco_zoo_models.hf import from_pretrained, save_pretrained
from redco_zoo_models.llama import LLAMA_PRESETS, LlamaConfig, LlamaForCausalLM
from redco_zoo_models.llava import LlavaConfig, LlavaForConditionalGeneration
from redco_zoo_models.lora import add_lora, merge_lora, save_peft_adapters
from redco_zoo_models.nnx_utils import split_model
from redco_zoo_models.t5 import T5Config, T5ForConditionalGeneration
from redco_zoo_models.vision_encoder_decoder import VisionEncoderDecoderConfig, VisionEncoderDecoderModel
from redco_zoo_models.vit import ViTConfig, ViTModel

__all__ = ["GPT2Config", "GPT2LMHeadModel", "LLAMA_PRESETS", "LlamaConfig", "LlamaForCausalLM",
           "T5Config", "T5ForConditionalGeneration", "ViTConfig", "ViTModel", "add_lora",
           "merge_lora", "moe_optimizer", "save_peft_adapters",
           "VisionEncoderDecoderConfig", "VisionEncoderDecoderModel", "from_pretrained",
           "generate", "save_pretrained", "split_model", "LlavaConfig",
           "LlavaForConditionalGeneration", "Gemma3VisionConfig", "Gemma3ForConditionalGeneration"]
