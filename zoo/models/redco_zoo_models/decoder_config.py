"""``DecoderConfig``: what differs between the LLaMA-like families, as data
(``redco_zoo_models.decoder`` reads it; ``family_config`` reads each family's config.json into it).

Every family is a stack of layers ``attention -> MLP`` with RMSNorm, RoPE, grouped-query
attention and a gated MLP. What differs:
* ``norm_layout``: ``pre`` (LLaMA, Qwen, Mistral, Phi-3: a norm before attention and the MLP),
  ``sandwich`` (Gemma 2/3: also a norm on each block's output before the residual add), ``post``
  (OLMo 2: only the output norms);
* ``qk_norm``: RMSNorm of queries and keys before RoPE, per head (``head``: Qwen3, Gemma 3) or over
  all heads at once (``all``: OLMo 2);
* ``norm_offset``: Gemma's norms scale by ``1 + weight``; ``embed_scale``: Gemma multiplies
  embeddings by ``sqrt(hidden_size)``; ``hidden_act``: the MLP's gate activation;
* ``query_pre_attn_scalar`` (Gemma: scores scaled by its ``** -0.5``), ``attn_softcap`` and
  ``final_softcap`` (Gemma 2: ``cap * tanh(x / cap)`` on attention scores and on logits);
* ``layer_types`` with ``sliding_window``: which layers attend to the last ``window`` slots only
  (Mistral, Gemma 2's every other layer, Gemma 3's five of six), each type with its own RoPE
  (``rope``; Gemma 3's and OLMo 3's local layers ``local_rope``; ``redco_zoo_models.rope``);
* ``nope_layers``: layers whose queries and keys turn no RoPE at all (SmolLM3's NoPE layers);
* ``n_experts`` (Mixtral, Qwen3-MoE): the MLP of each sparse layer is a Mixture-of-Experts block
  (``redco_zoo_models.moe``) of that many experts, ``experts_per_token`` of them per token. The
  blocks' load-balancing losses, weighted by ``router_aux_loss_coef``, are added to the loss
  the model returns given ``labels`` (the logits alone carry none). ``router`` ``sigmoid``
  (DeepSeek-V3) with ``n_group``/``topk_group``, ``routed_scaling_factor``, ``n_shared_experts``
  and the first ``first_k_dense_replace`` layers dense;
* ``attention_sinks`` (gpt-oss): a learned logit per head in every softmax's denominator
  (``redco_zoo_models.attention``), with biases on all four projections (``attention_bias``,
  ``o_proj_bias``); its MoE blocks' ``router_bias``, ``expert_bias`` and clamped SwiGLU
  (``swiglu_limit``, ``swiglu_alpha``: ``redco_zoo_models.layers.glu``);
* ``kv_lora_rank`` (DeepSeek-V3): multi-head latent attention (``redco_zoo_models.mla``) in
  place of grouped-query attention, ``head_dim`` being the size of its rotated part;
* ``mixers`` (hybrids: Granite 4): each layer's token mixer, attention or a Mamba2 layer
  (``redco_zoo_models.mamba2``, shaped by ``mamba``); Granite's ``embedding_multiplier``,
  ``attention_multiplier`` (the scores' scale), ``residual_multiplier`` (each block's output
  before the residual add) and ``logits_scaling`` (logits divided by it), and
  ``position_embedding`` ``None`` (no RoPE: NoPE);
* Falcon-H1 (``redco_zoo_models.falcon_h1``): every layer's mixer ``attention_mamba2``,
  attention and Mamba2 side by side on the same normed input, their outputs summed; muP-style
  multipliers as data: ``embedding_multiplier``, ``lm_head_multiplier`` (logits times it),
  ``key_multiplier`` (the keys), ``attention_in_multiplier``/``attention_out_multiplier`` and
  ``ssm_out_multiplier`` (the mixers' inputs and outputs; the Mamba2 layer's own in
  ``mamba``), ``mlp_multipliers`` (the MLP's gate projection and its output);
* Qwen3-Next, Qwen3.5: ``mixers`` from config.json's ``layer_types``, their linear layers a Gated
  DeltaNet (``redco_zoo_models.gated_deltanet``, sized by the
  ``linear_*`` fields; ``delta_chunk_size`` is the run's); ``attn_output_gate``: ``q_proj``
  gives each head's query and an output gate (``o_proj(out * sigmoid(gate))``);
  ``shared_expert_size`` with ``shared_expert_gate``: the MoE blocks' shared
  expert, scaled per token by ``sigmoid(shared_expert_gate(x))``.
* Nemotron-H (``redco_zoo_models.nemotron_h``): ``one_block``, each layer one block, a norm then
  its mixer *or* its MLP and a residual: a Mamba2 or attention (NoPE) layer has no MLP, and an
  MLP-only or MoE layer has no mixer (``Mixer.NONE``); ``gated_mlp`` off: the MLPs and experts
  are ``down(act(up(x)))`` (``relu2``); ``moe_latent_size``: the routed experts' width.
* Llama 4 (``redco_zoo_models.llama4_attention``): ``chunked_layers`` attend within blocks of
  ``attention_chunk_size`` positions; NoPE layers' queries scaled by position
  (``attn_temperature_tuning``, ``floor_scale``, ``attn_scale``); ``qk_norm`` ``l2``: queries
  and keys of RoPE layers L2-normalised (no weights) after RoPE; ``rope_interleave``: RoPE
  turns features in pairs (0, 1), (2, 3)...; ``router`` ``top_k_sigmoid`` with
  ``expert_input_scaled``: each expert's input scaled by ``sigmoid`` of its logit.
* Gemma 4 (``redco_zoo_models.gemma4``): ``v_norm`` (values RMS-normalised per head, no
  weights); full-attention layers of their own head size and key/value heads
  (``global_head_dim``, ``global_kv_heads``), their values the keys' projection (``k_eq_v``);
  the last ``kv_shared_layers`` layers reuse the keys and values of the last earlier layer of
  their type (``kv_source``), their MLPs twice as wide with ``double_wide_mlp``; per-layer
  input embeddings (``per_layer_input_size``, ``per_layer_vocab_size``) and a stored scalar on
  each layer's output (``layer_scalar``); ``moe_beside_mlp`` (``enable_moe_block``, the
  26B-A4B): every layer's dense MLP keeps its place and an MoE block of ``n_experts`` sits
  beside it, the two outputs normed and summed (``gemma4.with_moe``); its router normed and
  scaled, each chosen expert's weight times a learned scale (``moe.MoEConfig``).

``scan_layers`` is not the family's but the run's (no config.json key; ``from_pretrained(...,
scan_layers=False)``): runs of like layers stored stacked and run under ``jax.lax.scan``
(``redco_zoo_models.layer_scan``). The default, ``None``, scans every model that can be (all
but Gemma 4's with KV sharing or per-layer inputs: ``gemma4.scannable``); ``True`` insists
(refusing those), ``False`` unrolls the layers in a Python loop (for debugging: each layer its
own params and its own trace); ``scan_unroll`` (the run's too): how many
groups one step of the scan runs, unrolled inside its body (``jax.lax.scan``'s ``unroll``).
"""
from __future__ import annotations

import dataclasses
import enum

from redco_zoo_models import families, family_config, gemma4
from redco_zoo_models.gated_deltanet import DeltaNetConfig
from redco_zoo_models.mamba2 import Mamba2Config
from redco_zoo_models.moe import MoEConfig
from redco_zoo_models.rope import Rope


class Mixer(str, enum.Enum):
    """A layer's token mixer (``DecoderConfig.mixers``)."""
    ATTENTION = "attention"
    MAMBA2 = "mamba2"  # redco_zoo_models.mamba2
    GATED_DELTANET = "gated_deltanet"  # redco_zoo_models.gated_deltanet
    PARALLEL = "attention_mamba2"  # both, side by side (Falcon-H1: redco_zoo_models.falcon_h1)
    NONE = "none"  # no mixer: the layer is its MLP or MoE block alone (Nemotron-H's '-', 'E')


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int = 256
    hidden_size: int = 128
    intermediate_size: int = 352
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02  # from-scratch params' std (redco_zoo_models.hf_init)
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: biases on q, k, v
    o_proj_bias: bool = False  # gpt-oss: and on the output projection
    attention_sinks: bool = False  # gpt-oss: a learned sink logit per head
    max_position_embeddings: int = 4096
    family: str = "llama"  # whose config.json and tensor names it writes (families.FAMILIES)
    rope: Rope | None = None  # None: default RoPE with rope_theta over the whole head
    local_rope: Rope | None = None  # the sliding layers' RoPE, where it differs (Gemma 3)
    norm_layout: str = "pre"  # pre | sandwich | post
    qk_norm: str | None = None  # None | head | all | l2 (Llama 4)
    norm_offset: float = 0.0
    embed_scale: bool = False
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None  # scores scaled by its ** -0.5 (None: head_dim's)
    attn_softcap: float | None = None
    final_softcap: float | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None  # None: every layer sliding if a window is set
    nope_layers: tuple[int, ...] = ()  # layers whose attention turns no RoPE (SmolLM3's NoPE)
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    n_experts: int = 0  # Mixture-of-Experts MLPs (Mixtral, Qwen3-MoE); 0: dense
    experts_per_token: int = 0
    moe_intermediate_size: int = 0  # each expert's (0: intermediate_size)
    norm_topk_prob: bool = True  # the chosen experts' weights renormalised to sum to 1
    decoder_sparse_step: int = 1  # every step-th layer is sparse (Qwen3-MoE) ...
    mlp_only_layers: tuple[int, ...] = ()  # ... but these
    router_aux_loss_coef: float = 0.0
    router: str = "softmax"  # softmax | sigmoid (DeepSeek-V3) | top_k_sigmoid (Llama 4)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0  # the first layers' MLPs are dense (DeepSeek-V3)
    bias_update_rate: float = 1e-3  # sigmoid routing's balancing bias, per training step
    capacity_factor: float | None = None  # MoE: None dropless (a training choice, no config.json key)
    router_bias: bool = False  # gpt-oss: the router's linear has a bias, ...
    expert_bias: bool = False  # ... and so does every expert projection
    swiglu_limit: float | None = None  # gpt-oss: the experts' clamped SwiGLU
    swiglu_alpha: float = 1.702
    kv_lora_rank: int = 0  # multi-head latent attention (redco_zoo_models.mla); 0: GQA
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    mixers: tuple[Mixer, ...] | None = None  # each layer's mixer (hybrids); None: attention
    mamba: Mamba2Config | None = None  # the Mamba2 layers' shape
    embedding_multiplier: float = 1.0  # Granite's multipliers (see the module docstring)
    attention_multiplier: float | None = None
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    position_embedding: str | None = "rope"  # rope | None (NoPE: Granite 4 hybrid)
    lm_head_multiplier: float = 1.0  # Falcon-H1's multipliers (see the module docstring)
    key_multiplier: float = 1.0
    attention_in_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0
    mlp_multipliers: tuple[float, float] = (1.0, 1.0)  # the MLP's gate and down projections
    shared_expert_size: int = 0  # an MoE block's shared MLP (0: n_shared_experts * expert size)
    attn_output_gate: bool = False  # Qwen3-Next: q_proj also gives a sigmoid gate on the output
    linear_num_key_heads: int = 0  # the Gated DeltaNet layers' sizes (gated_deltanet)
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    delta_chunk_size: int = 64  # the chunked delta rule's chunk (a run's choice, no config.json key)
    shared_expert_gate: bool = False  # Qwen3-Next: the shared MLP gated per token by a sigmoid
    chunked_layers: tuple[int, ...] = ()  # Llama 4: layers attending within chunks ...
    attention_chunk_size: int | None = None  # ... of this many positions
    attn_temperature_tuning: bool = False  # Llama 4: NoPE layers' queries scaled by position
    floor_scale: float = 8192.0
    attn_scale: float = 0.1
    expert_input_scaled: bool = False  # Llama 4: the router's weight scales an expert's input
    v_norm: bool = False  # Gemma 4 (module docstring)
    global_head_dim: int = 0  # 0: head_dim
    global_kv_heads: int = 0  # 0: num_key_value_heads
    k_eq_v: bool = False
    kv_shared_layers: int = 0
    double_wide_mlp: bool = False
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    layer_scalar: bool = False
    moe_beside_mlp: bool = False  # Gemma 4's MoE block (module docstring)
    one_block: bool = False  # Nemotron-H: a layer is its mixer or its MLP, never both
    gated_mlp: bool = True  # False: MLPs and experts up_proj, down_proj only (Nemotron-H)
    moe_latent_size: int = 0  # Nemotron-H: the routed experts' width (0: hidden_size)
    scan_layers: bool | None = None  # stacked, under lax.scan (layer_scan); None: where it can; the run's
    scan_unroll: int = 1  # groups of layers one step of the scan runs (lax.scan's unroll); the run's

    def __post_init__(self):
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.rope is None:
            object.__setattr__(self, "rope", Rope(self.head_dim, self.rope_theta,
                                                  max_position_embeddings=self.max_position_embeddings))
        if self.mixers is not None:
            object.__setattr__(self, "mixers", tuple(Mixer(m) for m in self.mixers))
            if Mixer.NONE in self.mixers and not self.one_block:
                raise ValueError("A layer without a mixer (Mixer.NONE) is a layer of "
                                 "one_block models (Nemotron-H) only.")
            if len(self.mixers) != self.num_hidden_layers:
                raise ValueError(f"layer_types has {len(self.mixers)} entries for "
                                 f"{self.num_hidden_layers} layers.")
        if self.scan_layers is None:
            object.__setattr__(self, "scan_layers", gemma4.scannable(self))
        if self.scan_unroll < 1:
            raise ValueError(f"scan_unroll={self.scan_unroll}: the groups of layers one step of "
                             "the scan runs; use 1 (the default) or more.")
        if self.chunked_layers and not self.attention_chunk_size:
            raise ValueError(f"chunked_layers {self.chunked_layers} need an "
                             "attention_chunk_size (a positive number of positions).")
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                             f"{self.num_hidden_layers} layers.")
        gemma4.check(self)

    def attention_shape(self, layer: int) -> tuple[int, int]:
        """``(head_dim, key/value heads)`` of ``layer``'s attention (Gemma 4's full-attention
        layers: their own)."""
        wide = not self.sliding(layer)
        return ((wide and self.global_head_dim) or self.head_dim,
                (wide and self.global_kv_heads) or self.num_key_value_heads)

    def kv_source(self, layer: int) -> int | None:
        """The layer whose keys and values ``layer`` reuses (Gemma 4), or ``None``."""
        return gemma4.kv_source(self, layer)

    def mixer(self, layer: int) -> Mixer:
        return Mixer.ATTENTION if self.mixers is None else self.mixers[layer]

    def has_mlp(self, layer: int) -> bool:
        """Whether ``layer`` has an MLP (or MoE block): all but Nemotron-H's mixer layers."""
        return not self.one_block or self.mixer(layer) is Mixer.NONE

    def has_delta_net(self) -> bool:
        return self.mixers is not None and Mixer.GATED_DELTANET in self.mixers

    def delta_net(self) -> DeltaNetConfig:
        return DeltaNetConfig(self.hidden_size, self.linear_num_key_heads,
                              self.linear_num_value_heads, self.linear_key_head_dim,
                              self.linear_value_head_dim, self.linear_conv_kernel_dim,
                              self.rms_norm_eps, self.delta_chunk_size)

    def sliding(self, layer: int) -> bool:
        if self.sliding_window is None:
            return False
        return self.layer_types is None or self.layer_types[layer] == families.SLIDING

    def sparse(self, layer: int) -> bool:
        """Whether ``layer`` has a Mixture-of-Experts block: its MLP, or beside it
        (``moe_beside_mlp``)."""
        return self.n_experts > 0 and layer not in self.mlp_only_layers and \
            self.has_mlp(layer) and \
            (layer + 1) % self.decoder_sparse_step == 0 and layer >= self.first_k_dense_replace

    def moe(self) -> MoEConfig:
        return MoEConfig(self.hidden_size, self.n_experts, self.experts_per_token,
                         self.moe_intermediate_size or self.intermediate_size,
                         normalize_top_k=self.norm_topk_prob, hidden_act=self.hidden_act,
                         load_balancing_weight=self.router_aux_loss_coef, router=self.router,
                         n_group=self.n_group, topk_group=self.topk_group,
                         routed_scaling_factor=self.routed_scaling_factor,
                         n_shared_experts=self.n_shared_experts,
                         bias_update_rate=self.bias_update_rate,
                         capacity_factor=self.capacity_factor, router_bias=self.router_bias,
                         expert_bias=self.expert_bias, swiglu_limit=self.swiglu_limit,
                         swiglu_alpha=self.swiglu_alpha,
                         shared_expert_size=self.shared_expert_size,
                         shared_expert_gate=self.shared_expert_gate,
                         expert_input_scaled=self.expert_input_scaled,
                         router_norm=self.moe_beside_mlp, per_expert_scale=self.moe_beside_mlp,
                         norm_eps=self.rms_norm_eps, gated=self.gated_mlp,
                         latent_size=self.moe_latent_size)

    @classmethod
    def from_hf(cls, config: dict) -> "DecoderConfig":
        """From a HuggingFace ``config.json`` of any family in ``families.FAMILIES``."""
        return family_config.read_config(cls, config)

    def to_hf(self) -> dict:
        return family_config.write_config(self)
