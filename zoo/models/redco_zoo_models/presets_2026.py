"""The published shapes of the families of late 2026, as ``config.json`` contents (the
conventions of ``redco_zoo_models.presets``, which lists them with the others).

* Qwen3.5 (27B dense, 35B-A3B MoE) and Qwen3-Next-80B-A3B: three Gated DeltaNet layers to one
  gated full-attention layer (``layer_types``), RoPE on a quarter of each 256-wide head. Qwen3.5
  is published as an image-text model; its preset is the language model alone (the
  ``text_config`` of the hub's config, which ``family_config.text_part`` reads the same way),
  without the vision tower (about 0.4B parameters).
* OLMo 3 (7B, 32B): three sliding-window layers (4,096 tokens, plain RoPE) to one full layer
  (YaRN, x8 from 8,192), norms after each block, RMSNorm on all query and key features.
* GLM-4.5-Air: grouped-query attention with biases and RoPE on half of each head, the first
  layer dense, then 128 routed experts (8 a token, sigmoid routing) and one shared; the hub's
  multi-token-prediction layer is dropped, as on import.
* Llama-4-Scout (the language model of the image-text checkpoint): every layer's MLP 16 experts
  (one a token, sigmoid routing) beside a shared expert; three chunked-attention RoPE layers to
  one global NoPE layer with attention temperature tuning.
* Gemma 4 31B (dense) and 26B-A4B (a dense MLP beside 128 experts of 704, 8 a token, in every
  layer): five sliding layers (1,024 tokens) to one full layer whose heads are 512 wide, fewer
  (``num_global_key_value_heads``) and share keys and values (``attention_k_eq_v``). Their
  language models, as Qwen3.5's: the hub's ``text_config`` without the vision tower. The small
  sizes (E2B, E4B: per-layer inputs, shared key/value layers) load, but have no preset here.
"""
from __future__ import annotations

from typing import Any

from redco_zoo_models.families import FULL, SLIDING

LINEAR = "linear_attention"


def _every_fourth_full(layers: int, other: str) -> list[str]:
    return [FULL if (i + 1) % 4 == 0 else other for i in range(layers)]


def _qwen_hybrid(model_type: str, layers: int, hidden: int, heads: int, kv_heads: int,
                 value_heads: int, vocab: int, theta: float) -> dict[str, Any]:
    """What Qwen3.5 and Qwen3-Next share: gated attention over 256-wide heads, Gated DeltaNet
    with 16 key heads of 128 and ``value_heads`` value heads of 128, a 4-wide convolution."""
    return {"model_type": model_type, "vocab_size": vocab, "hidden_size": hidden,
            "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": 256, "hidden_act": "silu",
            "layer_types": _every_fourth_full(layers, LINEAR), "full_attention_interval": 4,
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
            "linear_value_head_dim": 128, "linear_num_value_heads": value_heads,
            "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
            "partial_rotary_factor": 0.25,
            "rope_parameters": {"rope_type": "default", "rope_theta": theta,
                                "partial_rotary_factor": 0.25},
            "attention_bias": False, "tie_word_embeddings": False}


def qwen3_5_27b() -> dict[str, Any]:
    """Qwen3.5-27B's language model: 64 layers of 5,120, a dense MLP of 17,408, 24 query and
    4 KV heads, 48 value heads in its DeltaNet layers."""
    return {**_qwen_hybrid("qwen3_5_text", 64, 5120, 24, 4, 48, 248320, 1e7),
            "architectures": ["Qwen3_5ForCausalLM"], "intermediate_size": 17408,
            "eos_token_id": 248044}


def qwen3_5_35b_a3b() -> dict[str, Any]:
    """Qwen3.5-35B-A3B's language model: 40 layers of 2,048, every MLP 256 experts of 512
    (8 a token) and a gated shared expert of 512."""
    return {**_qwen_hybrid("qwen3_5_moe_text", 40, 2048, 16, 2, 32, 248320, 1e7),
            "architectures": ["Qwen3_5MoeForCausalLM"], "num_experts": 256,
            "num_experts_per_tok": 8, "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512, "router_aux_loss_coef": 0.001,
            "eos_token_id": 248044}


def qwen3_next_80b_a3b() -> dict[str, Any]:
    """Qwen3-Next-80B-A3B: 48 layers of 2,048, every MLP 512 experts of 512 (10 a token,
    renormalised) and a gated shared expert of 512."""
    return {**_qwen_hybrid("qwen3_next", 48, 2048, 16, 2, 32, 151936, 1e7),
            "architectures": ["Qwen3NextForCausalLM"], "intermediate_size": 5120,
            "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512, "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.001,
            "bos_token_id": 151643, "eos_token_id": 151645}


def olmo3(hidden: int, ffn: int, layers: int, heads: int, kv_heads: int) -> dict[str, Any]:
    """OLMo 3 (``olmo3``): the 100,278-token vocabulary, untied embeddings, 65,536 tokens."""
    yarn = {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0,
            "original_max_position_embeddings": 8192, "attention_factor": 1.2079441541679836,
            "beta_fast": 32.0, "beta_slow": 1.0}
    return {"model_type": "olmo3", "architectures": ["Olmo3ForCausalLM"], "vocab_size": 100278,
            "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "hidden_act": "silu",
            "rms_norm_eps": 1e-6, "max_position_embeddings": 65536, "sliding_window": 4096,
            "layer_types": _every_fourth_full(layers, SLIDING),
            "rope_parameters": {FULL: yarn,
                                SLIDING: {"rope_type": "default", "rope_theta": 500000.0}},
            "attention_bias": False, "tie_word_embeddings": False,
            "pad_token_id": 100277, "eos_token_id": 100257}


def glm_4_5_air() -> dict[str, Any]:
    """GLM-4.5-Air (``glm4_moe``): 46 layers of 4,096, 96 query and 8 KV heads of 128 with
    biases; the first MLP dense (10,944), then 128 experts of 1,408 and one shared."""
    return {"model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"],
            "vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 10944,
            "num_hidden_layers": 46, "num_attention_heads": 96, "num_key_value_heads": 8,
            "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-5,
            "max_position_embeddings": 131072, "partial_rotary_factor": 0.5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                "partial_rotary_factor": 0.5},
            "attention_bias": True, "use_qk_norm": False, "moe_intermediate_size": 1408,
            "n_routed_experts": 128, "n_shared_experts": 1, "num_experts_per_tok": 8,
            "first_k_dense_replace": 1, "norm_topk_prob": True, "n_group": 1, "topk_group": 1,
            "routed_scaling_factor": 1.0, "tie_word_embeddings": False,
            "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338]}


def llama_4_scout() -> dict[str, Any]:
    """Llama-4-Scout-17B-16E's language model: 48 layers of 5,120, 40 query and 8 KV heads of
    128, experts of 8,192 and a shared expert of 8,192 in every layer, a 202,048-token vocab."""
    return {"model_type": "llama4_text", "architectures": ["Llama4ForCausalLM"],
            "vocab_size": 202048, "hidden_size": 5120, "intermediate_size": 8192,
            "intermediate_size_mlp": 16384, "num_hidden_layers": 48,
            "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
            "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 10485760,
            "num_local_experts": 16, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1,
            "no_rope_layer_interval": 4, "attention_chunk_size": 8192, "use_qk_norm": True,
            "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1,
            "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
                                "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                                "original_max_position_embeddings": 8192},
            "attention_bias": False, "tie_word_embeddings": False,
            "pad_token_id": 200018, "bos_token_id": 200000, "eos_token_id": [200001, 200007,
                                                                            200008]}


def gemma4(hidden: int, ffn: int, layers: int, heads: int, kv_heads: int, global_kv_heads: int,
           **moe: Any) -> dict[str, Any]:
    """Gemma 4's larger language models (no per-layer inputs, no shared key/value layers):
    256-wide sliding heads, 512-wide full heads whose keys are their values."""
    return {"model_type": "gemma4_text", "architectures": ["Gemma4ForCausalLM"],
            "vocab_size": 262144, "hidden_size": hidden, "intermediate_size": ffn,
            "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "num_global_key_value_heads": global_kv_heads,
            "head_dim": 256, "global_head_dim": 512, "attention_k_eq_v": True,
            "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
            "max_position_embeddings": 262144, "sliding_window": 1024,
            "layer_types": [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(layers)],
            "rope_parameters": {
                SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                       "rope_theta": 1000000.0}},
            "final_logit_softcapping": 30.0, "hidden_size_per_layer_input": 0,
            "num_kv_shared_layers": 0, "use_double_wide_mlp": False, "attention_bias": False,
            "tie_word_embeddings": True, "enable_moe_block": bool(moe), **moe,
            "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": [1, 106]}
