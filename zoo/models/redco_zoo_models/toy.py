"""Tiny models and word-level tokenizers, made in seconds without a hub: for tests, templates
and first runs. ``save_model_dir`` writes one as a HuggingFace directory, which is what every
zoo pipeline and template takes as ``--model``."""
from __future__ import annotations

import os

from flax import nnx

from redco_zoo_models.gpt2 import GPT2Config
from redco_zoo_models.hf import save_pretrained
from redco_zoo_models.llama import LlamaConfig, LlamaForCausalLM
from redco_zoo_models.t5 import T5Config, T5ForConditionalGeneration
from redco_zoo_models.vision_encoder_decoder import VisionEncoderDecoderConfig, VisionEncoderDecoderModel
from redco_zoo_models.vit import ViTConfig


def word_tokenizer(words: list[str], specials: tuple[str, ...] = ("<pad>", "</s>", "<unk>")):
    """A ``tokenizers`` tokenizer that splits on whitespace. Ids: ``specials`` first (so by
    default pad 0, eos 1), then ``words``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {w: i for i, w in enumerate(list(specials) + list(words))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer


def tiny_llama(vocab_size: int, seed: int = 0) -> LlamaForCausalLM:
    """A 2-layer LLaMA, width 64, 4 query and 2 key/value heads."""
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2), nnx.Rngs(seed))


def tiny_t5(vocab_size: int, seed: int = 0) -> T5ForConditionalGeneration:
    """A 2+2-layer T5, width 64, 4 heads; pad 0 starts the decoder, eos 1."""
    return T5ForConditionalGeneration(T5Config(
        vocab_size=vocab_size, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
        relative_attention_num_buckets=32, relative_attention_max_distance=64), nnx.Rngs(seed))


def tiny_vit_gpt2(vocab_size: int, image_size: int = 32, max_len: int = 8,
                  seed: int = 0) -> VisionEncoderDecoderModel:
    """A 2-layer ViT (8x8 patches) and a 2-layer GPT-2 that attends to it, width 64; pad 0,
    bos 1, eos 2."""
    return VisionEncoderDecoderModel(VisionEncoderDecoderConfig(
        encoder=ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=128, image_size=image_size, patch_size=8),
        decoder=GPT2Config(vocab_size=vocab_size, n_positions=max_len, n_embd=64, n_layer=2,
                           n_head=4, add_cross_attention=True, bos_token_id=1, eos_token_id=2),
        decoder_start_token_id=1, pad_token_id=0), nnx.Rngs(seed))


def save_model_dir(model: nnx.Module, tokenizer, path: str) -> str:
    """``model`` and ``tokenizer`` saved as a HuggingFace directory (config.json,
    model.safetensors, tokenizer.json). Returns ``path``."""
    save_pretrained(model, path)
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    return path
