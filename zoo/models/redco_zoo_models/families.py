"""What each decoder family's ``config.json`` says, in ``DecoderConfig``'s switches, and back.

A family is a few lines of data (``FAMILIES``): its HuggingFace class, the switches it fixes
(``redco_zoo_models.decoder``), the config keys it reads and their defaults (a key may set two
fields: gpt-oss's ``attention_bias`` puts biases on q/k/v and on the output projection), which
layers slide. Its checkpoint's tensor names (Phi-3's fused projections, the MoE families'
experts) are mapped to the zoo's in ``redco_zoo_models.family_tensors``. DeepSeek-V3's
``qk_rope_head_dim`` is the decoder's ``head_dim`` (the size RoPE turns), and its
``num_nextn_predict_layers`` (multi-token prediction) is not part of the causal LM. gpt-oss's
``experts_per_token`` and ``initial_context_length`` (its hub config's copies of
``num_experts_per_tok`` and of YaRN's original length) transformers ignores too. A few keys
are read through a function (``config_keys.DERIVED``): SmolLM3's ``no_rope_layers`` (1 where
a layer turns RoPE) become ``nope_layers``, GLM-4.5's ``use_qk_norm`` per-head q/k norms;
MiniMax-M2's legacy ``rotary_dim`` is its ``partial_rotary_factor`` times ``head_dim``.
Llama 4's ``use_qk_norm`` is its weightless L2 norm (``qk_norm="l2"``), its ``moe_layers`` (or
``interleave_moe_layer_step``) the sparse layers and its ``layer_types`` the chunked ones; its
``intermediate_size`` sizes the experts (and shared expert), ``intermediate_size_mlp`` the dense
layers' MLPs (``redco_zoo_models.llama4_attention``).
Gemma 4 (``gemma4_text``; ``redco_zoo_models.gemma4``): Gemma 3's layout with its own switches and
``per_layer_config`` or ``global_head_dim`` for the full-attention layers, and its MoE block's
keys (``enable_moe_block`` and the three it sizes) read as a whole (``config_keys``).
OLMo 3, as Gemma 3, keeps a RoPE for each layer type (``rope_parameters`` keyed by type; its
sliding layers take ``rope_theta`` where Gemma 3's take ``rope_local_base_freq``).
Nemotron-H's layers (``layers_block_type`` or ``hybrid_override_pattern``), its Mamba2 keys
and latent size are read through ``nemotron_h.read_layers``; ``num_hidden_layers`` is the
pattern's length, as transformers reads it.

A key the family does not read is refused, naming it, unless it is off or metadata
(``redco_zoo_models.config_keys`` says which is which): a softcap, a window or MoE fields are
never silently dropped; an Unsloth save's ``unsloth_version`` is read with a warning.
"""
from __future__ import annotations

import dataclasses

from redco_zoo_models import config_keys, mamba2, nemotron_h

SLIDING, FULL = "sliding_attention", "full_attention"

COMMON = {  # read for every family: DecoderConfig field -> config.json key
    "vocab_size": "vocab_size", "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size", "num_hidden_layers": "num_hidden_layers",
    "num_attention_heads": "num_attention_heads", "num_key_value_heads": "num_key_value_heads",
    "head_dim": "head_dim", "rms_norm_eps": "rms_norm_eps",
    "initializer_range": "initializer_range",
    "tie_word_embeddings": "tie_word_embeddings",
    "max_position_embeddings": "max_position_embeddings", "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id", "pad_token_id": "pad_token_id",
}
ROPE_KEYS = {"rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor"}


@dataclasses.dataclass(frozen=True)
class Family:
    architecture: str
    switches: dict = dataclasses.field(default_factory=dict)  # DecoderConfig fields it fixes
    reads: dict = dataclasses.field(default_factory=dict)  # config key -> (field, default)
    windows: str = "none"  # none | all | qwen, smollm3 (use_sliding_window) | gemma2 | gemma3 |
    #                        gemma4 | alternate | olmo3 (_layer_types)
    fused: bool = False  # Phi-3: qkv_proj and gate_up_proj in the checkpoint (family_tensors)
    tied_default: bool = False
    ignores: frozenset = frozenset()  # keys transformers' class of this family ignores too
    defaults: dict = dataclasses.field(default_factory=dict)  # config.json keys it may omit
    experts: str | None = None  # an MoE checkpoint's layout: qwen | mixtral | deepseek | gpt_oss
    #                             | minimax | qwen_next | llama4 | gemma4 (family_tensors)
    linear: str | None = None  # the mixer of layer_types' linear layers: mamba2 | gated_deltanet
    fused_delta_net: bool = False  # Qwen3-Next: in_proj_qkvz, in_proj_ba (family_tensors)
    derived: tuple = ()  # keys read through functions (config_keys.DERIVED)
    rotary_dim: bool = False  # MiniMax-M2: the rotated features as a count, ``rotary_dim``
    parallel: bool = False  # Falcon-H1: attention and Mamba2 side by side in every layer

    def own_keys(self) -> set:
        """The config keys this family reads beyond ``COMMON`` and RoPE's."""
        derived = {k for d in self.derived for k in config_keys.DERIVED[d].keys}
        return set(self.reads) | self.ignores | derived | self._mixer_keys() | (
            {"rotary_dim"} if self.rotary_dim else set())

    def _mixer_keys(self) -> set:
        if self.parallel:
            return set(mamba2.KEYS) | set(mamba2.PARALLEL_KEYS) | {"layers_block_type"}
        if self.linear == "mamba2":
            return set(mamba2.KEYS) | {"layer_types", "layers_block_type"}
        return {"layer_types", "full_attention_interval"} if self.linear else set()




GEMMA = dict(norm_layout="sandwich", norm_offset=1.0, embed_scale=True)
GEMMA_READS = {"hidden_activation": ("hidden_act", "gelu_pytorch_tanh"),
               "query_pre_attn_scalar": ("query_pre_attn_scalar", 256),
               "attn_logit_softcapping": ("attn_softcap", None),
               "final_logit_softcapping": ("final_softcap", None)}
MOE_READS = {"num_experts_per_tok": ("experts_per_token", 2),
             "router_aux_loss_coef": ("router_aux_loss_coef", 0.001)}
MOE_IGNORES = frozenset({"output_router_logits", "router_jitter_noise"})  # training-time only
MTP = frozenset({"num_nextn_predict_layers", "num_mtp_layers"})  # (not the LM)
GATED_DELTANET = dict(norm_offset=1.0, qk_norm="head", attn_output_gate=True)
GATED_DELTANET_READS = {"attention_bias": ("attention_bias", False),
                        "hidden_act": ("hidden_act", "silu"),
                        "linear_num_key_heads": ("linear_num_key_heads", 16),
                        "linear_num_value_heads": ("linear_num_value_heads", 32),
                        "linear_key_head_dim": ("linear_key_head_dim", 128),
                        "linear_value_head_dim": ("linear_value_head_dim", 128),
                        "linear_conv_kernel_dim": ("linear_conv_kernel_dim", 4)}
SHARED_EXPERT_READS = {**MOE_READS, "num_experts": ("n_experts", 512),
                       "moe_intermediate_size": ("moe_intermediate_size", 512),
                       "shared_expert_intermediate_size": ("shared_expert_size", 512)}
QWEN3_5_IGNORES = frozenset({"mtp_num_hidden_layers", "mtp_use_dedicated_embeddings",
                             "attn_output_gate", "mamba_ssm_dtype"})
FAMILIES = {
    "llama": Family("LlamaForCausalLM", reads={"attention_bias": ("attention_bias", False),
                                               "hidden_act": ("hidden_act", "silu")}),
    "mistral": Family("MistralForCausalLM", reads={"hidden_act": ("hidden_act", "silu")},
                      windows="all"),
    "qwen2": Family("Qwen2ForCausalLM", switches={"attention_bias": True},
                    reads={"hidden_act": ("hidden_act", "silu")}, windows="qwen"),
    "qwen3": Family("Qwen3ForCausalLM", switches={"qk_norm": "head"},
                    reads={"attention_bias": ("attention_bias", False),
                           "hidden_act": ("hidden_act", "silu")}, windows="qwen"),
    "gemma2": Family("Gemma2ForCausalLM", switches=GEMMA, reads=GEMMA_READS, windows="gemma2",
                     tied_default=True, ignores=frozenset({"hidden_act"})),
    "gemma3_text": Family("Gemma3ForCausalLM", switches={**GEMMA, "qk_norm": "head"},
                          reads=GEMMA_READS, windows="gemma3", tied_default=True,
                          defaults={"rope_theta": 1_000_000.0},
                          ignores=frozenset({"hidden_act"})),
    "phi3": Family("Phi3ForCausalLM", reads={"hidden_act": ("hidden_act", "silu")},
                   windows="all", fused=True, defaults={"rms_norm_eps": 1e-5}),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", switches={"qk_norm": "head"},
                        reads={"attention_bias": ("attention_bias", False),
                               "hidden_act": ("hidden_act", "silu"), **MOE_READS,
                               "num_experts": ("n_experts", 128),  # (hub configs)
                               "num_local_experts": ("n_experts", 128),  # (transformers 5's)
                               "moe_intermediate_size": ("moe_intermediate_size", 768),
                               "norm_topk_prob": ("norm_topk_prob", False),
                               "decoder_sparse_step": ("decoder_sparse_step", 1),
                               "mlp_only_layers": ("mlp_only_layers", ())},
                        windows="qwen", experts="qwen", ignores=MOE_IGNORES),
    "mixtral": Family("MixtralForCausalLM", switches={"norm_topk_prob": True},
                      reads={"hidden_act": ("hidden_act", "silu"), **MOE_READS,
                             "num_local_experts": ("n_experts", 8)},
                      windows="all", experts="mixtral", ignores=MOE_IGNORES),
    "deepseek_v3": Family(
        "DeepseekV3ForCausalLM", switches={"router": "sigmoid"},
        reads={"attention_bias": ("attention_bias", False), "hidden_act": ("hidden_act", "silu"),
               "num_experts_per_tok": ("experts_per_token", 8),
               "n_routed_experts": ("n_experts", 256),
               "moe_intermediate_size": ("moe_intermediate_size", 2048),
               "norm_topk_prob": ("norm_topk_prob", True), "n_group": ("n_group", 8),
               "topk_group": ("topk_group", 4), "routed_scaling_factor": (
                   "routed_scaling_factor", 2.5), "n_shared_experts": ("n_shared_experts", 1),
               "first_k_dense_replace": ("first_k_dense_replace", 3),
               "kv_lora_rank": ("kv_lora_rank", 512), "q_lora_rank": ("q_lora_rank", None),
               "qk_nope_head_dim": ("qk_nope_head_dim", 128),
               "qk_rope_head_dim": ("head_dim", 64), "v_head_dim": ("v_head_dim", 128),
               "rope_interleave": ("rope_interleave", True)},
        experts="deepseek", ignores=MOE_IGNORES | MTP | {"qk_head_dim"}),
    "gpt_oss": Family(  # every layer sparse; attention sinks; biased router and experts
        "GptOssForCausalLM", switches={"attention_sinks": True, "router_bias": True,
                                       "expert_bias": True, "norm_topk_prob": True},
        reads={"attention_bias": (("attention_bias", "o_proj_bias"), True),
               "num_experts_per_tok": ("experts_per_token", 4),
               "router_aux_loss_coef": ("router_aux_loss_coef", 0.001),
               "num_local_experts": ("n_experts", 128), "swiglu_limit": ("swiglu_limit", 7.0),
               "swiglu_alpha": ("swiglu_alpha", 1.702)},
        windows="alternate", experts="gpt_oss", defaults={"rms_norm_eps": 1e-5,
                                                          "sliding_window": 128},
        ignores=MOE_IGNORES | {"hidden_act", "experts_per_token", "initial_context_length"}),
    "granitemoehybrid": Family(  # Granite 4 hybrid: Mamba2 and attention layers, multipliers
        "GraniteMoeHybridForCausalLM", switches={"norm_topk_prob": True, "n_shared_experts": 1},
        reads={"attention_bias": ("attention_bias", False), "hidden_act": ("hidden_act", "silu"),
               "embedding_multiplier": ("embedding_multiplier", 1.0),
               "attention_multiplier": ("attention_multiplier", 1.0),
               "residual_multiplier": ("residual_multiplier", 1.0),
               "logits_scaling": ("logits_scaling", 1.0),
               "position_embedding_type": ("position_embedding", None),
               "intermediate_size": ("moe_intermediate_size", 11008),  # (the experts')
               "shared_intermediate_size": (("intermediate_size", "shared_expert_size"), 1024),
               "num_local_experts": ("n_experts", 8), "num_experts_per_tok": (
                   "experts_per_token", 2), "router_aux_loss_coef": ("router_aux_loss_coef", 0.001)},
        linear="mamba2", ignores=MOE_IGNORES),
    "falcon_h1": Family(  # attention and Mamba2 in parallel in every layer; muP multipliers
        "FalconH1ForCausalLM", reads={
            "attention_bias": (("attention_bias", "o_proj_bias"), False),
            "hidden_act": ("hidden_act", "silu"),
            "embedding_multiplier": ("embedding_multiplier", 1.0),
            "lm_head_multiplier": ("lm_head_multiplier", 1.0),
            "key_multiplier": ("key_multiplier", 1.0),
            "attention_in_multiplier": ("attention_in_multiplier", 1.0),
            "attention_out_multiplier": ("attention_out_multiplier", 1.0),
            "ssm_out_multiplier": ("ssm_out_multiplier", 1.0),
            "mlp_multipliers": ("mlp_multipliers", (1.0, 1.0))},
        linear="mamba2", parallel=True, ignores=frozenset({"num_logits_to_keep"}),
        defaults={"rms_norm_eps": 1e-5}),
    "qwen3_next": Family(  # Gated DeltaNet and gated attention layers; shared expert
        "Qwen3NextForCausalLM", switches={**GATED_DELTANET, "shared_expert_gate": True},
        reads={**GATED_DELTANET_READS, **SHARED_EXPERT_READS,
               "norm_topk_prob": ("norm_topk_prob", True),
               "decoder_sparse_step": ("decoder_sparse_step", 1),
               "mlp_only_layers": ("mlp_only_layers", ())},
        experts="qwen_next", linear="gated_deltanet", fused_delta_net=True, ignores=MOE_IGNORES,
        defaults={"partial_rotary_factor": 0.25}),
    "qwen3_5_text": Family("Qwen3_5ForCausalLM", switches=GATED_DELTANET,
                           reads=GATED_DELTANET_READS, linear="gated_deltanet", ignores=QWEN3_5_IGNORES,
                           defaults={"partial_rotary_factor": 0.25}),
    "qwen3_5_moe_text": Family(  # every layer sparse, top-k weights renormalised
        "Qwen3_5MoeForCausalLM", switches={**GATED_DELTANET, "shared_expert_gate": True,
                                           "norm_topk_prob": True},
        reads={**GATED_DELTANET_READS, **SHARED_EXPERT_READS}, experts="qwen_next",
        linear="gated_deltanet", ignores=MOE_IGNORES | QWEN3_5_IGNORES,
        defaults={"partial_rotary_factor": 0.25}),
    "olmo2": Family("Olmo2ForCausalLM", switches={"norm_layout": "post", "qk_norm": "all"},
                    reads={"attention_bias": ("attention_bias", False),
                           "hidden_act": ("hidden_act", "silu")},
                    defaults={"rms_norm_eps": 1e-5}),
    "olmo3": Family("Olmo3ForCausalLM", switches={"norm_layout": "post", "qk_norm": "all"},
                    reads={"attention_bias": ("attention_bias", False),
                           "hidden_act": ("hidden_act", "silu")}, windows="olmo3",
                    defaults={"rms_norm_eps": 1e-5, "sliding_window": 4096,
                              "rope_theta": 500_000.0}),
    "smollm3": Family("SmolLM3ForCausalLM", reads={"attention_bias": ("attention_bias", False),
                                                   "hidden_act": ("hidden_act", "silu")},
                      windows="smollm3", tied_default=True, derived=("no_rope_layers",)),
    "seed_oss": Family("SeedOssForCausalLM", reads={
        "attention_bias": ("attention_bias", True), "attention_out_bias": ("o_proj_bias", False),
        "hidden_act": ("hidden_act", "silu")}, defaults={"head_dim": 128}),
    "glm4_moe": Family(  # DeepSeek-V3's MoE (sigmoid routing, shared experts) on GQA
        "Glm4MoeForCausalLM", switches={"router": "sigmoid"},
        reads={"attention_bias": ("attention_bias", False), "hidden_act": ("hidden_act", "silu"),
               "num_experts_per_tok": ("experts_per_token", 8),
               "n_routed_experts": ("n_experts", 128),
               "moe_intermediate_size": ("moe_intermediate_size", 1408),
               "norm_topk_prob": ("norm_topk_prob", True), "n_group": ("n_group", 1),
               "topk_group": ("topk_group", 1), "routed_scaling_factor": (
                   "routed_scaling_factor", 1.0), "n_shared_experts": ("n_shared_experts", 1),
               "first_k_dense_replace": ("first_k_dense_replace", 1)},
        experts="deepseek", derived=("use_qk_norm",), ignores=MOE_IGNORES | MTP,
        defaults={"rms_norm_eps": 1e-5, "partial_rotary_factor": 0.5}),
    "minimax_m2": Family(  # every layer sparse, sigmoid routing; q/k norms over all heads
        "MiniMaxM2ForCausalLM", switches={"router": "sigmoid", "qk_norm": "all",
                                          "norm_topk_prob": True},
        reads={"hidden_act": ("hidden_act", "silu"),
               "num_experts_per_tok": ("experts_per_token", 8),
               "router_aux_loss_coef": ("router_aux_loss_coef", 0.001),
               "num_local_experts": ("n_experts", 256)},
        experts="minimax", rotary_dim=True, defaults={"head_dim": 128},
        ignores=MOE_IGNORES | {"use_qk_norm"}),  # (always on in transformers' class)
    "llama4_text": Family(  # MoE every n-th layer, experts fed router-scaled inputs; NoPE
        "Llama4ForCausalLM", switches={"router": "top_k_sigmoid", "norm_topk_prob": False,
                                       "expert_input_scaled": True, "rope_interleave": True},
        reads={"attention_bias": (("attention_bias", "o_proj_bias"), False),
               "hidden_act": ("hidden_act", "silu"), **MOE_READS,
               "num_experts_per_tok": ("experts_per_token", 1),
               "num_local_experts": ("n_experts", 16),
               "intermediate_size": (("moe_intermediate_size", "shared_expert_size"), 8192),
               "intermediate_size_mlp": ("intermediate_size", 16384),  # (the dense layers')
               "attention_chunk_size": ("attention_chunk_size", 8192),
               "attn_temperature_tuning": ("attn_temperature_tuning", True),
               "floor_scale": ("floor_scale", 8192), "attn_scale": ("attn_scale", 0.1)},
        experts="llama4", derived=("no_rope_layers", "use_l2_qk_norm", "llama4_layers"),
        ignores=MOE_IGNORES, defaults={"intermediate_size_mlp": 16384, "use_qk_norm": True,
                                       "rope_theta": 500_000.0}),
    "gemma4_text": Family(  # Gemma 3's norms without the offset, more (redco_zoo_models.gemma4)
        "Gemma4ForCausalLM", switches={**GEMMA, "norm_offset": 0.0, "qk_norm": "head",
                                       "v_norm": True, "attention_multiplier": 1.0,
                                       "layer_scalar": True, "norm_topk_prob": True},
        reads={"hidden_activation": ("hidden_act", "gelu_pytorch_tanh"),
               "final_logit_softcapping": ("final_softcap", None),
               "attention_bias": (("attention_bias", "o_proj_bias"), False),
               "hidden_size_per_layer_input": ("per_layer_input_size", 256),
               "vocab_size_per_layer_input": ("per_layer_vocab_size", 262_144),
               "attention_k_eq_v": ("k_eq_v", False),
               "num_kv_shared_layers": ("kv_shared_layers", 0),
               "use_double_wide_mlp": ("double_wide_mlp", False)},
        windows="gemma4", tied_default=True, derived=("gemma4_layers", "gemma4_moe"),
        experts="gemma4",
        defaults={"head_dim": 256, "sliding_window": 512, "rope_parameters": {
            SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
            FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                   "rope_theta": 1_000_000.0}}}),
    "nemotron_h": Family(  # one block a layer: Mamba2, NoPE attention, relu2 MLP or MoE
        "NemotronHForCausalLM", switches={"one_block": True, "gated_mlp": False,
                                          "position_embedding": None, "router": "sigmoid"},
        reads={"layer_norm_epsilon": ("rms_norm_eps", 1e-5),
               "mlp_hidden_act": ("hidden_act", "relu2"),
               "n_routed_experts": ("n_experts", 8), "num_experts_per_tok": (
                   "experts_per_token", 2), "moe_intermediate_size": ("moe_intermediate_size",
                                                                      7688),
               "moe_shared_expert_intermediate_size": ("shared_expert_size", 7688),
               "norm_topk_prob": ("norm_topk_prob", True), "n_group": ("n_group", 1),
               "topk_group": ("topk_group", 1),
               "routed_scaling_factor": ("routed_scaling_factor", 1.0)},
        derived=("nemotron_h_layers",), ignores=nemotron_h.IGNORES | MTP,
        defaults={"head_dim": 128, "num_key_value_heads": 8}),
}


COMPUTING = config_keys.computing(FAMILIES, COMMON, ROPE_KEYS)
NOT_YET = {}  # model_type -> what the zoo's decoder lacks to read it
