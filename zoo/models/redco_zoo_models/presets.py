"""Published decoder shapes as HuggingFace ``config.json`` contents, by name.

``PRESETS[name]`` is what the model's ``config.json`` on the Hub says (transformers 5's layout:
RoPE in ``rope_parameters``), so ``DecoderConfig.from_hf(PRESETS[name])`` builds the model's
shape with random weights: for ``redco plan --model qwen3-8b`` and the zoo pipelines'
``--model qwen3-8b --from_scratch``. Only what changes the computation (and the token ids) is
written; training-only keys (dropout, initializer range) are left out.

``PUBLISHED_PARAMS[name]`` is the parameter count the model's publisher gives (model card or
report), for checking a preset against it. For Gemma 3 4B/12B/27B it is the text model's
(embedding + non-embedding, Gemma 3 report Table 1), without the 417M vision encoder: the
presets are the ``gemma3_text`` decoders.

The older ``llama-1b`` ... ``llama-65b`` shapes (``LlamaConfig`` fields, not ``config.json``
contents) stay in ``redco_zoo_models.llama.LLAMA_PRESETS``; the families of late 2026 (Qwen3.5,
Qwen3-Next, OLMo 3, GLM-4.5-Air, Llama 4 Scout, Gemma 4) are written in ``presets_2026``.
"""
from __future__ import annotations

import copy
from typing import Any

from redco_zoo_models import presets_2026

SLIDING, FULL = "sliding_attention", "full_attention"


def _llama3(hidden: int, ffn: int, layers: int, heads: int, head_dim: int, factor: float,
            tied: bool) -> dict[str, Any]:
    """Llama 3.1 (``factor`` 8) and 3.2 (``factor`` 32): grouped-query attention with 8 KV
    heads, the 128,256-token vocabulary, ``llama3`` RoPE scaling from 8,192 to 131,072."""
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
            "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": 8, "head_dim": head_dim,
            "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
            "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0,
                                "factor": factor, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192},
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": tied,
            "bos_token_id": 128000, "eos_token_id": 128001}


def _qwen3(hidden: int, ffn: int, layers: int, heads: int, tied: bool) -> dict[str, Any]:
    """Qwen3 (dense): 8 KV heads of 128, RMSNorm on queries and keys, no sliding window."""
    return {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936,
            "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": 8, "head_dim": 128,
            "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": layers, "tie_word_embeddings": tied,
            "bos_token_id": 151643, "eos_token_id": 151645}


def _gemma3(hidden: int, ffn: int, layers: int, heads: int, kv_heads: int, head_dim: int,
            window: int, vocab: int = 262208, scalar: int = 256, full_rope: dict | None = None,
            longest: int = 131072) -> dict[str, Any]:
    """Gemma 3's text decoder: five sliding-window layers (RoPE theta 10k) to one global
    (theta 1M, linearly scaled by 8 from 4B up), sandwich norms, tied embeddings."""
    full_rope = full_rope or {"rope_type": "linear", "factor": 8.0}
    return {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
            "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": ffn,
            "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": head_dim,
            "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
            "max_position_embeddings": longest, "query_pre_attn_scalar": scalar,
            "sliding_window": window,
            "layer_types": [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(layers)],
            "rope_parameters": {FULL: {**full_rope, "rope_theta": 1000000.0},
                                SLIDING: {"rope_type": "default", "rope_theta": 10000.0}},
            "attn_logit_softcapping": None, "final_logit_softcapping": None,
            "attention_bias": False, "tie_word_embeddings": True,
            "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}


# Phi-4-mini's LongRoPE factors, one per rotary frequency: its rotary dimension is 0.75 of the
# 128-wide head, 96, so 48 of each. As published in microsoft/Phi-4-mini-instruct's
# config.json (memory planning does not depend on them: they only change the frequencies).
PHI4_MINI_LONG_FACTOR = [
    1.0, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817,
    2.187582649, 2.446418898, 2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023,
    4.785517845, 5.351743533, 5.984965424, 6.693110555, 7.485043894, 8.370679318, 9.36110372,
    10.4687158, 11.70738129, 13.09260651, 14.64173252, 16.37415215, 18.31155283, 20.47818807,
    22.90118105, 25.61086418, 28.64115884, 32.03, 32.1, 32.13, 32.23, 32.6, 32.61, 32.64,
    32.66, 32.7, 32.71, 32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77]


def _phi4_mini() -> dict[str, Any]:
    """Phi-4-mini (``phi3``): 24 heads of 128 with 8 KV heads, RoPE on 96 of 128 features
    (LongRoPE from 4,096 to 131,072), a 200,064-token vocabulary, tied embeddings."""
    return {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "vocab_size": 200064,
            "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
            "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128,
            "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096, "partial_rotary_factor": 0.75,
            "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                "short_factor": [1.0] * 48,
                                "long_factor": list(PHI4_MINI_LONG_FACTOR)},
            "sliding_window": 262144, "attention_bias": False, "tie_word_embeddings": True,
            "bos_token_id": 199999, "eos_token_id": 199999, "pad_token_id": 199999}


def _mixtral_8x7b() -> dict[str, Any]:
    """Mixtral-8x7B (mistralai/Mixtral-8x7B-v0.1): 32 layers, every MLP 8 experts of 14,336,
    2 per token; 8 KV heads of 128, no sliding window."""
    return {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": 32000,
            "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 32768,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_window": None, "num_local_experts": 8, "num_experts_per_tok": 2,
            "router_aux_loss_coef": 0.02, "tie_word_embeddings": False,
            "bos_token_id": 1, "eos_token_id": 2}


def _qwen3_30b_a3b() -> dict[str, Any]:
    """Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B): 48 layers, every MLP 128 experts of 768, 8 per
    token (renormalised); 32 query and 4 KV heads of 128."""
    return {**_qwen3(2048, 6144, 48, 32, tied=False), "model_type": "qwen3_moe",
            "architectures": ["Qwen3MoeForCausalLM"], "num_key_value_heads": 4,
            "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "router_aux_loss_coef": 0.001}


def _deepseek_v3() -> dict[str, Any]:
    """DeepSeek-V3 (deepseek-ai/DeepSeek-V3, without the multi-token-prediction layer): 61
    layers, the first 3 dense (18,432), then 256 routed experts of 2,048 (8 per token, sigmoid
    routing within 4 of 8 groups, scaled by 2.5) and one shared; latent attention (MLA) with
    128 heads, KV rank 512, Q rank 1,536; YaRN RoPE (x40 from 4,096)."""
    return {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
            "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
            "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
            "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
            "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
            "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
            "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
            "norm_topk_prob": True, "hidden_act": "silu", "rms_norm_eps": 1e-6,
            "max_position_embeddings": 163840,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                "original_max_position_embeddings": 4096, "beta_fast": 32,
                                "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
            "attention_bias": False, "tie_word_embeddings": False,
            "bos_token_id": 0, "eos_token_id": 1}


def _gpt_oss_20b() -> dict[str, Any]:
    """gpt-oss-20b (openai/gpt-oss-20b, its bf16 shape: the hub's weights are MXFP4, which the
    zoo does not read): 24 layers alternating a 128-token window and full attention, each with
    64 query and 8 KV heads of 64, biases and a sink per head, and 32 experts of 2,880 (4 per
    token, biased router and experts, SwiGLU clamped at 7); YaRN RoPE (x32 from 4,096)."""
    return {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"],
            "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
            "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
            "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4,
            "router_aux_loss_coef": 0.9, "swiglu_limit": 7.0, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 131072, "sliding_window": 128,
            "layer_types": [SLIDING if i % 2 == 0 else FULL for i in range(24)],
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                "original_max_position_embeddings": 4096},
            "attention_bias": True, "tie_word_embeddings": False,
            "eos_token_id": 200002, "pad_token_id": 199999}


PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": _llama3(2048, 8192, 16, 32, 64, 32.0, tied=True),
    "llama-3.2-3b": _llama3(3072, 8192, 28, 24, 128, 32.0, tied=True),
    "llama-3.1-8b": _llama3(4096, 14336, 32, 32, 128, 8.0, tied=False),
    "llama-3.1-70b": _llama3(8192, 28672, 80, 64, 128, 8.0, tied=False),
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, tied=True),
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, tied=True),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, tied=True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, tied=False),
    "qwen3-14b": _qwen3(5120, 17408, 40, 40, tied=False),
    "qwen3-32b": _qwen3(5120, 25600, 64, 64, tied=False),
    "gemma-3-1b": _gemma3(1152, 6912, 26, 4, 1, 256, window=512, vocab=262144,
                          full_rope={"rope_type": "default"}, longest=32768),
    "gemma-3-4b": _gemma3(2560, 10240, 34, 8, 4, 256, window=1024),
    "gemma-3-12b": _gemma3(3840, 15360, 48, 16, 8, 256, window=1024),
    "gemma-3-27b": _gemma3(5376, 21504, 62, 32, 16, 128, window=1024, scalar=168),
    "phi-4-mini": _phi4_mini(),
    "mixtral-8x7b": _mixtral_8x7b(),
    "qwen3-30b-a3b": _qwen3_30b_a3b(),
    "deepseek-v3": _deepseek_v3(),
    "gpt-oss-20b": _gpt_oss_20b(),
    "qwen3.5-27b": presets_2026.qwen3_5_27b(),
    "qwen3.5-35b-a3b": presets_2026.qwen3_5_35b_a3b(),
    "qwen3-next-80b-a3b": presets_2026.qwen3_next_80b_a3b(),
    "olmo-3-7b": presets_2026.olmo3(4096, 11008, 32, 32, 32),
    "olmo-3-32b": presets_2026.olmo3(5120, 27648, 64, 40, 8),
    "glm-4.5-air": presets_2026.glm_4_5_air(),
    "llama-4-scout": presets_2026.llama_4_scout(),
    "gemma-4-31b": presets_2026.gemma4(5376, 21504, 60, 32, 16, 4),
    "gemma-4-26b-a4b": presets_2026.gemma4(2816, 2112, 30, 16, 8, 2, num_experts=128,
                                           top_k_experts=8, moe_intermediate_size=704),
}

PUBLISHED_PARAMS: dict[str, float] = {  # name -> parameters, as the publisher counts them
    "llama-3.2-1b": 1.24e9, "llama-3.2-3b": 3.21e9, "llama-3.1-8b": 8.03e9,
    "llama-3.1-70b": 70.6e9,
    "qwen3-0.6b": 0.6e9, "qwen3-1.7b": 1.7e9, "qwen3-4b": 4.0e9, "qwen3-8b": 8.2e9,
    "qwen3-14b": 14.8e9, "qwen3-32b": 32.8e9,
    "gemma-3-1b": 1.000e9, "gemma-3-4b": 3.884e9, "gemma-3-12b": 11.771e9,
    "gemma-3-27b": 27.016e9,
    "phi-4-mini": 3.84e9,
    "mixtral-8x7b": 46.7e9, "qwen3-30b-a3b": 30.5e9, "deepseek-v3": 671e9,
    "gpt-oss-20b": 20.91e9,  # (the model card's, bf16 count)
    # Qwen3.5's cards count the vision tower too (about 0.4B; these presets are the language
    # models); OLMo 3's are the hub's safetensors counts (the names round: 7B, 32B);
    # GLM-4.5-Air's card: 106B total.
    "qwen3.5-27b": 27e9, "qwen3.5-35b-a3b": 35e9, "qwen3-next-80b-a3b": 80e9,
    "olmo-3-7b": 7.30e9, "olmo-3-32b": 32.2e9, "glm-4.5-air": 106e9,
    # Llama 4 Scout's and Gemma 4's cards count their vision towers too (Scout: 109B total;
    # Gemma 4: 30.7B and 25.2B); these presets are the language models.
    "llama-4-scout": 109e9, "gemma-4-31b": 30.7e9, "gemma-4-26b-a4b": 25.2e9,
}


def preset(name: str) -> dict[str, Any]:
    """A copy of ``PRESETS[name]``; an unknown name is refused with the list of names."""
    if name not in PRESETS:
        raise KeyError(f"No preset {name!r}: the presets are {', '.join(PRESETS)}.")
    return copy.deepcopy(PRESETS[name])
