"""A tiny LLaVA and its real transformers processor, made in seconds without a hub: for tests
and first runs of image + text fine-tuning (``redco zoo run sft``) and serving (``redco
serve``). The processor is transformers' ``LlavaProcessor``: CLIP's PIL image processor
(every image resized to 32 x 32, whatever its size, then normalised) and a word-level chat
tokenizer (``toy.chat_word_tokenizer``) whose ``<image>`` the processor expands to the 64
image tokens the tower's 8 x 8 patches give. ``save_tiny_qwen_vl``: a tiny Qwen2.5-VL with its
real image processor (images keep their sizes: 4-pixel patches, 2 x 2 merged) and a
word-level tokenizer holding Qwen's vision tokens."""
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
