"""A tiny LLaVA and its real transformers processor, made in seconds without a hub: for tests
and first runs of image + text fine-tuning (``redco zoo run sft``) and serving (``redco
serve``). The processor is transformers' ``LlavaProcessor``: CLIP's PIL image processor
(every image resized to 32 x 32, whatever its size, then normalised) and a word-level chat
tokenizer (``toy.chat_word_tokenizer``) whose ``<image>`` the processor expands to the 64
image tokens the tower's 8 x 8 patches give. ``save_tiny_qwen_vl``: a tiny Qwen2.5-VL with its
real image processor (images keep their sizes: 4-pixel patches, 2 x 2 merged) and a
word-level tokenizer holding Qwen's vision tokens. ``save_tiny_gemma3``: a tiny Gemma 3 (a
2-layer SigLIP tower, each image pooled to 4 soft tokens, a sliding and a global layer) and its
real ``Gemma3Processor``, whose ``<start_of_image>`` expands to those 4 image tokens."""
from __future__ import annotations

from flax import nnx

from redco_zoo_models.llava import LlavaConfig, LlavaForConditionalGeneration
from redco_zoo_models.toy import CHAT_SPECIALS, chat_word_tokenizer, save_model_dir

IMAGE_TOKEN, IMAGE_SIZE, PATCH = "<image>", 32, 4
TINY_CLIP = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                 num_hidden_layers=2, num_attention_heads=4, image_size=IMAGE_SIZE,
                 patch_size=PATCH)


def tiny_llava_processor(words: list[str]):
    """``LlavaProcessor`` of ``chat_word_tokenizer(words + ["<image>"])`` (ChatML template)."""
    from transformers import CLIPImageProcessorPil, LlavaProcessor
    tokenizer = chat_word_tokenizer([*words, IMAGE_TOKEN],
                                    extra_special_tokens={"image_token": IMAGE_TOKEN})
    images = CLIPImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                                   do_center_crop=False)
    return LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=PATCH,
                          vision_feature_select_strategy="default",
                          num_additional_image_tokens=1, chat_template=tokenizer.chat_template)


def save_tiny_llava(path: str, words: list[str], seed: int = 0) -> str:
    """A tiny LLaVA (a 2-layer CLIP tower, a 2-layer LLaMA of width 64) drawn from ``seed``, and
    ``tiny_llava_processor(words)``, saved as a HuggingFace directory. Returns ``path``."""
    processor = tiny_llava_processor(words)
    tokenizer = processor.tokenizer
    vocab = len(CHAT_SPECIALS) + len(words) + 1
    config = LlavaConfig.from_hf(dict(
        vision_config=TINY_CLIP, image_token_index=tokenizer.image_token_id,
        image_seq_length=(IMAGE_SIZE // PATCH) ** 2,
        text_config=dict(model_type="llama", vocab_size=vocab, hidden_size=64,
                         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, initializer_range=64 ** -0.5,
                         eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)))
    save_model_dir(LlavaForConditionalGeneration(config, nnx.Rngs(seed)), tokenizer._tokenizer,
                   path)
    processor.save_pretrained(path)  # the image processor, tokenizer and chat template
    return path


QWEN_SPECIALS = {"vision_start_token": "<|vision_start|>", "image_token": "<|image_pad|>",
                 "vision_end_token": "<|vision_end|>", "video_token": "<|video_pad|>"}
TINY_QWEN_VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=4, patch_size=4,
                        spatial_merge_size=2, temporal_patch_size=2, window_size=16,
                        out_hidden_size=64, fullatt_block_indexes=[1])  # (2 x 2-block windows)


def save_tiny_qwen_vl(path: str, words: list[str], seed: int = 0,
                      max_pixels: int = 32 * 32) -> str:
    """A tiny Qwen2.5-VL (a 2-block tower, a 2-layer Qwen2 of width 64, M-RoPE sections 2, 3,
    3) drawn from ``seed``, its ``chat_word_tokenizer(words)`` with Qwen's vision tokens, and
    transformers' ``Qwen2VLImageProcessorPil`` (images resized to multiples of 8 pixels, at most
    ``max_pixels``) saved as a HuggingFace directory whose ``processor_config.json`` names
    ``Qwen2_5_VLProcessor``. Returns ``path``."""
    import json

    from transformers import Qwen2VLImageProcessorPil

    from redco_zoo_models.qwen_vl import QwenVLForConditionalGeneration
    from redco_zoo_models.qwen_vl_config import QwenVLConfig
    tokenizer = chat_word_tokenizer([*words, *QWEN_SPECIALS.values()],
                                    extra_special_tokens=QWEN_SPECIALS)
    ids = {k.replace("_token", "_token_id"): tokenizer.convert_tokens_to_ids(v)
           for k, v in QWEN_SPECIALS.items()}
    config = QwenVLConfig.from_hf(dict(
        vision_config=TINY_QWEN_VISION, **ids,
        text_config=dict(vocab_size=len(CHAT_SPECIALS) + len(words) + len(QWEN_SPECIALS),
                         hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         initializer_range=64 ** -0.5, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, rope_parameters={
                             "rope_type": "default", "mrope_section": [2, 3, 3]})))
    save_model_dir(QwenVLForConditionalGeneration(config, nnx.Rngs(seed)), tokenizer._tokenizer,
                   path)
    tokenizer.save_pretrained(path)  # tokenizer_config.json and the chat template
    images = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                      min_pixels=8 * 8, max_pixels=max_pixels)
    with open(f"{path}/processor_config.json", "w") as f:  # (as a Qwen2.5-VL checkpoint's)
        json.dump({"processor_class": "Qwen2_5_VLProcessor",
                   "image_processor": images.to_dict()}, f, indent=2)
    return path


GEMMA3_SPECIALS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>",
                   "eoi_token": "<end_of_image>"}
TINY_SIGLIP = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=48,
                   num_hidden_layers=2, num_attention_heads=4, image_size=IMAGE_SIZE,
                   patch_size=8)


def save_tiny_gemma3(path: str, words: list[str], seed: int = 0) -> str:
    """A tiny Gemma 3 (module docstring) drawn from ``seed`` (its projector starts at zero, as
    transformers'; its head untied: tied, its scaled embeddings make it repeat its input), its
    ``chat_word_tokenizer(words)`` with Gemma 3's image tokens and transformers'
    ``Gemma3Processor`` (images resized to 32 x 32), saved as a HuggingFace directory. Returns
    ``path``."""
    from transformers import Gemma3ImageProcessorPil, Gemma3Processor

    from redco_zoo_models.gemma3_vision import (
        Gemma3ForConditionalGeneration,
        Gemma3VisionConfig,
    )
    tokenizer = chat_word_tokenizer([*words, *GEMMA3_SPECIALS.values()],
                                    extra_special_tokens=GEMMA3_SPECIALS)
    ids = {k.replace("_token", "_token_index"): tokenizer.convert_tokens_to_ids(v)
           for k, v in GEMMA3_SPECIALS.items()}
    config = Gemma3VisionConfig.from_hf(dict(
        vision_config=TINY_SIGLIP, mm_tokens_per_image=4, **ids, tie_word_embeddings=False,
        text_config=dict(model_type="gemma3_text", vocab_size=len(tokenizer), hidden_size=32,
                         intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, sliding_window=3,
                         layer_types=["sliding_attention", "full_attention"],
                         eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)))
    save_model_dir(Gemma3ForConditionalGeneration(config, nnx.Rngs(seed)), tokenizer._tokenizer,
                   path)
    images = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    Gemma3Processor(image_processor=images, tokenizer=tokenizer, image_seq_length=4,
                    chat_template=tokenizer.chat_template).save_pretrained(path)
    return path
