"""Tiny models and word-level tokenizers, made in seconds without a hub: for tests, templates
and first runs. ``save_model_dir`` writes one as a HuggingFace directory, which is what every
zoo pipeline and template takes as ``--model``."""
from __future__ import annotations

import dataclasses
import os
from typing import Any

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


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHAT_SPECIALS = ("<pad>", "<|im_end|>", "<unk>", "<|im_start|>")


def chat_word_tokenizer(words: list[str], template: str | None = CHATML, **special):
    """A word-level tokenizer with ChatML's special tokens and chat template, as transformers
    loads one (``PreTrainedTokenizerFast``). Ids: pad 0, ``<|im_end|>`` 1 (the EOS), unk 2,
    ``<|im_start|>`` 3, then ``words``; the roles ``system``, ``user`` and ``assistant`` must be
    among ``words``; ``special``: more of its special tokens (``extra_special_tokens``)."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    tokenizer = word_tokenizer(words, CHAT_SPECIALS)
    tokenizer.add_special_tokens([AddedToken(s, special=True) for s in CHAT_SPECIALS])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, chat_template=template,
                                   pad_token="<pad>", eos_token="<|im_end|>", unk_token="<unk>",
                                   **special)


def save_tiny_chat_model(path: str, words: list[str], seed: int = 0,
                         family: str | None = None, **config: Any) -> str:
    """A ``tiny_llama`` (or a tiny model of ``TINY_FAMILIES[family]``, e.g. ``"qwen3-moe"``,
    its config.json entries ``config`` replaced) and its ``chat_word_tokenizer(words)`` saved
    as a HuggingFace directory whose tokenizer has a chat template: what ``redco zoo run sft``
    (and dpo, grpo) take as ``--model``. Returns ``path``."""
    if config and family is None:
        raise ValueError(f"config entries {sorted(config)} replace a family's: pass family= "
                         "(a name in TINY_FAMILIES) with them")
    tokenizer = chat_word_tokenizer(words)
    vocab_size = len(CHAT_SPECIALS) + len(words)
    model = tiny_llama(vocab_size, seed) if family is None else LlamaForCausalLM(
        LlamaConfig.from_hf(dict(TINY_FAMILIES[family], vocab_size=vocab_size,
                                 eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id, **config)),
        nnx.Rngs(seed))
    save_model_dir(model, tokenizer._tokenizer, path)
    tokenizer.save_pretrained(path)  # tokenizer_config.json and the chat template
    return path


def tiny_llama(vocab_size: int, seed: int = 0, **changes) -> LlamaForCausalLM:
    """A 2-layer LLaMA, width 64, 4 query and 2 key/value heads, drawn at std
    ``1/sqrt(64)`` (``initializer_range``): transformers' 0.02 suits widths in the thousands;
    at width 64 it leaves attention scores near 0 and a few epochs learn little past the
    unigram statistics. ``changes`` to its config (``scan_layers=False``: unrolled)."""
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, initializer_range=64 ** -0.5, **changes),
        nnx.Rngs(seed))


WINDOW, ORIGINAL_CONTEXT = 8, 16  # every tiny family's sliding window and RoPE's original length
_TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             eos_token_id=63, pad_token_id=0, bos_token_id=1)
_LLAMA3 = dict(rope_type="llama3", rope_theta=500000.0, low_freq_factor=1.0,
               high_freq_factor=4.0, original_max_position_embeddings=ORIGINAL_CONTEXT)
_MAMBA = dict(mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4,
              mamba_expand=2, mamba_chunk_size=8)
_DELTA_NET = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                  linear_value_head_dim=6, linear_conv_kernel_dim=3,
                  layer_types=["linear_attention", "full_attention", "linear_attention"])
DELTA_NET_FAMILIES = ("qwen3.5", "qwen3-next", "qwen3.5-moe")  # parity: test_parity_gated_deltanet
TINY_FAMILIES = {  # config.json contents of a tiny model of each family, as transformers writes
    "llama-3.1": dict(_TINY, model_type="llama", rope_parameters=dict(_LLAMA3, factor=8.0)),
    "llama-3.2": dict(_TINY, model_type="llama", tie_word_embeddings=True, head_dim=16,
                      rope_parameters=dict(_LLAMA3, factor=32.0)),
    "qwen3": dict(_TINY, model_type="qwen3", head_dim=16,
                  rope_parameters=dict(rope_type="default", rope_theta=1e6)),
    "gemma2": dict(_TINY, model_type="gemma2", head_dim=16, sliding_window=WINDOW,
                   query_pre_attn_scalar=12, final_logit_softcapping=3.0,
                   attn_logit_softcapping=2.0),
    "gemma3": dict(_TINY, model_type="gemma3_text", head_dim=16, sliding_window=WINDOW,
                   num_hidden_layers=4, query_pre_attn_scalar=16,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                "sliding_attention"],
                   rope_parameters={
                       "full_attention": dict(rope_type="linear", factor=4.0, rope_theta=1e6),
                       "sliding_attention": dict(rope_type="default", rope_theta=1e4)}),
    "phi-4-mini": dict(_TINY, model_type="phi3", tie_word_embeddings=True,
                       original_max_position_embeddings=ORIGINAL_CONTEXT, rope_parameters=dict(
                           rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
                           short_factor=[1.0, 1.1, 1.3], long_factor=[2.0, 3.5, 5.0])),
    "phi-3-window": dict(_TINY, model_type="phi3", sliding_window=WINDOW),
    "olmo2": dict(_TINY, model_type="olmo2"),
    "qwen3-moe": dict(_TINY, model_type="qwen3_moe", head_dim=16, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True,
                      mlp_only_layers=[1], rope_parameters=dict(rope_type="default",
                                                                rope_theta=1e6)),
    "mixtral": dict(_TINY, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=WINDOW),
    "mistral": dict(_TINY, model_type="mistral", sliding_window=WINDOW),
    "gpt-oss": dict(  # sinks, biased router and experts; a limit the clamped SwiGLU reaches
        _TINY, model_type="gpt_oss", head_dim=16, intermediate_size=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=WINDOW, swiglu_limit=1.0, num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=150000.0, beta_fast=32.0,
                             beta_slow=1.0, truncate=False,
                             original_max_position_embeddings=ORIGINAL_CONTEXT)),
    "deepseek-v3": dict(  # 8 experts in 4 groups, a token's 2 from its best 2 groups
        _TINY, model_type="deepseek_v3", num_key_value_heads=4, n_routed_experts=8,
        num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=16,
        first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5,
        q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
        rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=10000.0, mscale=1.0,
                             mscale_all_dim=0.8, original_max_position_embeddings=ORIGINAL_CONTEXT)),
    "qwen3.5": dict(  # Gated DeltaNet (linear) layers around a gated full-attention one
        _TINY, model_type="qwen3_5_text", head_dim=8, **_DELTA_NET,
        rope_parameters=dict(rope_type="default", rope_theta=1e6, partial_rotary_factor=0.5)),
    "qwen3-next": dict(  # and MoE blocks with a gated shared expert, a dense one between
        _TINY, model_type="qwen3_next", head_dim=8, **_DELTA_NET, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
        mlp_only_layers=[1], rope_parameters=dict(rope_type="default", rope_theta=1e6,
                                                  partial_rotary_factor=0.25)),
    "qwen3.5-moe": dict(
        _TINY, model_type="qwen3_5_moe_text", head_dim=8, **_DELTA_NET, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
        rope_parameters=dict(rope_type="default", rope_theta=1e6, partial_rotary_factor=0.5)),
    "deepseek-v3-plain-q": dict(  # no query latent, RoPE in halves, one group
        _TINY, model_type="deepseek_v3", num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=16,
        first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=12, rope_interleave=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    "olmo3": dict(  # OLMo 2's post-norms and q/k norms; windows and a RoPE for each type
        _TINY, model_type="olmo3", sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": dict(
            rope_type="yarn", factor=4.0, rope_theta=5e5, attention_factor=1.2,
            beta_fast=32.0, beta_slow=1.0, original_max_position_embeddings=ORIGINAL_CONTEXT),
            "sliding_attention": dict(rope_type="default", rope_theta=5e5)}),
    "smollm3": dict(  # a layer without RoPE (NoPE), sliding; tied head
        _TINY, model_type="smollm3", no_rope_layers=[1, 0, 1], use_sliding_window=True,
        sliding_window=WINDOW, rope_parameters=dict(rope_type="default", rope_theta=5e6)),
    "seed-oss": dict(_TINY, model_type="seed_oss", head_dim=16, attention_bias=True,
                     attention_out_bias=True, rope_parameters=dict(rope_type="default",
                                                                   rope_theta=1e7)),
    "glm4-moe": dict(  # DeepSeek-V3's routing and shared expert on GQA with half-rotary heads
        _TINY, model_type="glm4_moe", head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
        n_group=1, topk_group=1, moe_intermediate_size=16, first_k_dense_replace=1,
        n_shared_experts=1, routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True,
        rope_parameters=dict(rope_type="default", rope_theta=1e6, partial_rotary_factor=0.5)),
    "minimax-m2": dict(  # sigmoid routing with a balancing bias, q/k norms over all heads
        _TINY, model_type="minimax_m2", head_dim=16, rotary_dim=8, num_local_experts=4,
        num_experts_per_tok=2, intermediate_size=16,
        rope_parameters=dict(rope_type="default", rope_theta=5e6)),
    "qwen3-yarn": dict(_TINY, model_type="qwen3", head_dim=8, rope_parameters=dict(
        rope_type="yarn", factor=4.0, rope_theta=10000.0,
        original_max_position_embeddings=ORIGINAL_CONTEXT)),
    "granite-4-h": dict(  # Mamba2 (chunks of 8, conv width 4), attention, MoE + shared MLP, NoPE
        _TINY, model_type="granitemoehybrid", layer_types=["mamba", "attention", "mamba"],
        **_MAMBA, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=40,
        intermediate_size=24, embedding_multiplier=3.0, attention_multiplier=0.3,
        residual_multiplier=0.7, logits_scaling=2.5, position_embedding_type="nope"),
    "granite-4-h-dense": dict(  # no experts, RoPE, biased Mamba2 projections, all layers Mamba2
        _TINY, model_type="granitemoehybrid", layer_types=["mamba", "mamba", "attention"],
        **_MAMBA, num_local_experts=0, shared_intermediate_size=48, mamba_proj_bias=True,
        position_embedding_type="rope", rope_parameters=dict(rope_type="default",
                                                             rope_theta=1e4)),
    "falcon-h1": dict(  # attention beside Mamba2 (chunks of 8, conv 4, d_ssm apart from
        _TINY, model_type="falcon_h1", **_MAMBA, mamba_d_ssm=48,  # expand * hidden), every
        mamba_rms_norm=True, mamba_norm_before_gate=True,  # multiplier off 1
        embedding_multiplier=2.0, lm_head_multiplier=0.6, key_multiplier=1.3,
        attention_in_multiplier=0.8, attention_out_multiplier=1.2, ssm_in_multiplier=0.9,
        ssm_out_multiplier=1.1, mlp_multipliers=[1.4, 0.7],
        ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.9], rope_parameters=dict(
            rope_type="default", rope_theta=1e4)),
    "falcon-h1-plain-gate": dict(  # no gated norm (y * silu(z)): the hub's Falcon-H1 default;
        _TINY, model_type="falcon_h1", **_MAMBA, mamba_rms_norm=False,  # biased projectors
        projectors_bias=True, attention_bias=True, rope_parameters=dict(
            rope_type="default", rope_theta=1e4)),
    "nemotron-h": dict(  # one block a layer: Mamba2 (chunks of 8, conv 4, d_inner 48 apart from
        _TINY, model_type="nemotron_h", num_hidden_layers=6, head_dim=8,  # expand * hidden,
        layers_block_type=["linear_attention", "mlp"] * 2 + [  # biased projections; M- twice:
            "full_attention", "moe"],  # a scanned group), NoPE attention, relu2 MLPs, MoE:
        mamba_num_heads=4, mamba_head_dim=12, n_groups=2, ssm_state_size=8, conv_kernel=4,
        chunk_size=8, use_bias=True, n_routed_experts=4, num_experts_per_tok=2,  # sigmoid
        moe_intermediate_size=16, moe_shared_expert_intermediate_size=24,  # routing, scaled,
        moe_latent_size=16, routed_scaling_factor=2.5,  # a latent projection, shared expert;
        time_step_min=1e-7),  # (a floor dt never meets: transformers' decoding step skips it,
    #                           see nemotron_h; the floor: test_parity_hybrid)
    "llama4": dict(  # chunks of 8 on RoPE layers, a NoPE layer with temperature tuning (a
        _TINY, model_type="llama4_text", head_dim=8, attention_bias=True,  # floor_scale the
        attention_chunk_size=WINDOW, no_rope_layers=[1, 0, 1], floor_scale=4,  # prompts cross)
        attn_scale=0.5, interleave_moe_layer_step=2, num_local_experts=4, num_experts_per_tok=2,
        intermediate_size=16, intermediate_size_mlp=48,
        rope_parameters=dict(_LLAMA3, factor=8.0)),
    "gemma4": dict(  # per-layer inputs; full layers with their own head size, proportional
        _TINY, model_type="gemma4_text", head_dim=8, num_hidden_layers=5,  # RoPE; the last 2
        sliding_window=WINDOW, global_head_dim=16, num_kv_shared_layers=2,  # layers share
        use_double_wide_mlp=True, hidden_size_per_layer_input=4,  # keys and values (keys as
        vocab_size_per_layer_input=64, final_logit_softcapping=3.0,  # values: its own file)
        layer_types=["sliding_attention", "full_attention", "sliding_attention",
                     "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": dict(rope_type="proportional", rope_theta=1e6,
                                                partial_rotary_factor=0.5),
                         "sliding_attention": dict(rope_type="default", rope_theta=1e4)}),
    "llama-dynamic": dict(_TINY, model_type="llama", max_position_embeddings=ORIGINAL_CONTEXT,
                          rope_parameters=dict(rope_type="dynamic", factor=2.0,
                                               rope_theta=10000.0)),
}


def tiny_family(name: str, seed: int = 0, **changes) -> LlamaForCausalLM:
    """A tiny model of a family in ``TINY_FAMILIES`` (random weights); ``changes`` to its
    config (``scan_layers=False``: unrolled)."""
    cfg = dataclasses.replace(LlamaConfig.from_hf(TINY_FAMILIES[name]), **changes)
    return LlamaForCausalLM(cfg, nnx.Rngs(seed))


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
