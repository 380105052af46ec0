"""Hand-written Megatron-LM tensor-parallel plans for the architectures of ``hf_archs``.

Written once, by hand, from the published layouts, and independent of redco's rule sets (this
module imports nothing from redco): Megatron-LM (Shoeybi et al. 2019, section 3) splits Q, K, V
(or the fused QKV) and the MLP's first matmul(s) column-parallel (their output features, so
heads stay whole on one shard), the attention output and the MLP's last matmul row-parallel
(their input features), the token embedding and the LM head (tied or not) on the vocabulary,
and replicates everything else: norms, position embeddings, the biases of row layers. The bias
of a column layer is split with its output features; a bias added to the logits (BERT's
``cls/predictions/bias``, BART's ``final_logits_bias``, GPT-J's ``lm_head/bias``) is split on
the vocabulary with them (Megatron's ``BertLMHead`` holds its bias as ``mpu_vocab_size``).

Three choices where a family's reference implementation is the authority:

* grouped-query K and V (LLaMA, Mistral): column-parallel while the KV heads divide the shards;
  with fewer KV heads than shards they are replicated, as vLLM's ``QKVParallelLinear`` does
  (Megatron-LM itself refuses that case);
* ViT's ``classifier``: replicated, as Megatron's ``VitClassificationModel.head`` (a plain
  ``torch.nn.Linear``); BERT's MLM ``transform/dense`` and RoBERTa's ``lm_head/dense``:
  replicated, as Megatron's ``BertLMHead.dense``;
* T5's ``relative_attention_bias`` (buckets x heads): a position embedding, replicated.

A plan is a table ``[(regex, role), ...]`` per family, first match wins (``re.search`` on the
``/``-joined param path); every param must match a row (``specs`` fails otherwise).
"""
from __future__ import annotations

import re

from jax.sharding import PartitionSpec as P

# roles
COL = "column"  # kernel: split its output features
ROW = "row"  # kernel: split its input features
COL_BIAS = "column bias"  # bias of a column kernel (or of the logits): split its last dim
VOCAB = "vocab"  # token table (vocab, hidden): split the rows
KV = "kv"  # K or V kernel of grouped-query attention: column if the KV heads divide, else whole
REP = "replicated"

DECODER = [  # LLaMA and Mistral
    (r"/self_attn/q_proj/kernel$", COL),
    (r"/self_attn/[kv]_proj/kernel$", KV),
    (r"/self_attn/o_proj/kernel$", ROW),
    (r"/mlp/(gate_proj|up_proj)/kernel$", COL),
    (r"/mlp/down_proj/kernel$", ROW),
    (r"embed_tokens/embedding$", VOCAB),
    (r"^lm_head/kernel$", COL),  # (hidden, vocab), untied
    (r"norm/weight$", REP),
]
BART = [  # BART and mBART: self- and cross-attention alike
    (r"_attn/[qkv]_proj/kernel$", COL), (r"_attn/[qkv]_proj/bias$", COL_BIAS),
    (r"_attn/out_proj/kernel$", ROW), (r"_attn/out_proj/bias$", REP),
    (r"/fc1/kernel$", COL), (r"/fc1/bias$", COL_BIAS),
    (r"/fc2/kernel$", ROW), (r"/fc2/bias$", REP),
    (r"^model/shared/embedding$", VOCAB),  # encoder, decoder and the tied LM head
    (r"^final_logits_bias$", COL_BIAS),  # (1, vocab), added to the logits
    (r"layer_?norm|embed_positions", REP),
]
BERT = [  # BERT and RoBERTa, masked LM heads
    (r"/attention/self/(query|key|value)/kernel$", COL),
    (r"/attention/self/(query|key|value)/bias$", COL_BIAS),
    (r"/intermediate/dense/kernel$", COL), (r"/intermediate/dense/bias$", COL_BIAS),
    (r"/layer/\d+/(attention/)?output/dense/kernel$", ROW),
    (r"/layer/\d+/(attention/)?output/dense/bias$", REP),
    (r"/word_embeddings/embedding$", VOCAB),  # the lookup and the tied decoder
    (r"^(cls/predictions|lm_head)/bias$", COL_BIAS),  # the logits' bias
    (r"^(cls/predictions/transform|lm_head)/dense/", REP),  # BertLMHead.dense
    (r"LayerNorm|layer_norm|position_embeddings|token_type_embeddings", REP),
]
PLANS = {
    # GPT-2's Conv1D stores kernels (out, in): see CONV1D below
    "gpt2": [
        (r"/attn/c_attn/kernel$", COL), (r"/attn/c_attn/bias$", COL_BIAS),  # fused [Q|K|V]
        (r"/attn/c_proj/kernel$", ROW), (r"/attn/c_proj/bias$", REP),
        (r"/mlp/c_fc/kernel$", COL), (r"/mlp/c_fc/bias$", COL_BIAS),
        (r"/mlp/c_proj/kernel$", ROW), (r"/mlp/c_proj/bias$", REP),
        (r"/wte/embedding$", VOCAB),  # tied LM head
        (r"/(ln_1|ln_2|ln_f)/|/wpe/embedding$", REP),
    ],
    "gptj": [
        (r"/attn/[qkv]_proj/kernel$", COL), (r"/attn/out_proj/kernel$", ROW),
        (r"/mlp/fc_in/kernel$", COL), (r"/mlp/fc_in/bias$", COL_BIAS),
        (r"/mlp/fc_out/kernel$", ROW), (r"/mlp/fc_out/bias$", REP),
        (r"/wte/embedding$", VOCAB),
        (r"^lm_head/kernel$", COL), (r"^lm_head/bias$", COL_BIAS),  # untied, with a bias
        (r"/(ln_1|ln_f)/", REP),
    ],
    "gpt_neo": [  # nn.Dense kernels (in, out), unlike GPT-2
        (r"/attention/[qkv]_proj/kernel$", COL),
        (r"/attention/out_proj/kernel$", ROW), (r"/attention/out_proj/bias$", REP),
        (r"/mlp/c_fc/kernel$", COL), (r"/mlp/c_fc/bias$", COL_BIAS),
        (r"/mlp/c_proj/kernel$", ROW), (r"/mlp/c_proj/bias$", REP),
        (r"/wte/embedding$", VOCAB),  # tied LM head
        (r"/(ln_1|ln_2|ln_f)/|/wpe/embedding$", REP),
    ],
    "opt": [
        (r"/self_attn/[qkv]_proj/kernel$", COL), (r"/self_attn/[qkv]_proj/bias$", COL_BIAS),
        (r"/self_attn/out_proj/kernel$", ROW), (r"/self_attn/out_proj/bias$", REP),
        (r"/fc1/kernel$", COL), (r"/fc1/bias$", COL_BIAS),
        (r"/fc2/kernel$", ROW), (r"/fc2/bias$", REP),
        (r"/embed_tokens/embedding$", VOCAB),  # tied LM head
        (r"layer_norm|embed_positions", REP),
    ],
    "llama": DECODER,
    "mistral": DECODER,
    "bart": BART,
    "mbart": BART,
    "vit": [
        (r"/attention/attention/(query|key|value)/kernel$", COL),
        (r"/attention/attention/(query|key|value)/bias$", COL_BIAS),
        (r"/intermediate/dense/kernel$", COL), (r"/intermediate/dense/bias$", COL_BIAS),
        (r"/(attention/)?output/dense/kernel$", ROW), (r"/(attention/)?output/dense/bias$", REP),
        (r"^classifier/", REP),  # Megatron's ViT head: a plain Linear
        (r"layernorm|cls_token|position_embeddings|patch_embeddings", REP),
    ],
    "bert": BERT,
    "roberta": BERT,
    "t5": [
        (r"/(SelfAttention|EncDecAttention)/[qkv]/kernel$", COL),
        (r"/(SelfAttention|EncDecAttention)/o/kernel$", ROW),
        (r"/DenseReluDense/(wi|wi_0|wi_1)/kernel$", COL),
        (r"/DenseReluDense/wo/kernel$", ROW),
        (r"^shared/embedding$", VOCAB),  # tied LM head (T5 v1.0)
        (r"^lm_head/kernel$", COL),  # untied (T5 v1.1)
        (r"layer_norm|relative_attention_bias", REP),
    ],
}
CONV1D = {"gpt2"}  # kernels stored (out, in) and transposed for the matmul


def role_spec(role: str, ndim: int, conv1d: bool, kv_heads_divide: bool) -> P:
    """The PartitionSpec over mesh axis ``'mp'`` of a param of ``ndim`` dims with ``role``."""
    out_dim, in_dim = (0, 1) if conv1d else (1, 0)
    if role == KV:
        role = COL if kv_heads_divide else REP
    split = {COL: out_dim, ROW: in_dim, VOCAB: 0, COL_BIAS: ndim - 1, REP: None}[role]
    return P() if split is None else P(*["mp" if d == split else None for d in range(ndim)])


def specs(arch: str, shapes: dict[str, tuple], mp: int, kv_heads: int | None = None) -> dict:
    """``{path: PartitionSpec}`` of the Megatron plan of ``arch`` at ``mp`` shards. Fails on a
    param no row of the plan names, and on a split dim that ``mp`` does not divide (the plan
    would be silently different from Megatron's)."""
    table, out = PLANS[arch], {}
    for path, shape in shapes.items():
        role = next((r for pattern, r in table if re.search(pattern, path)), None)
        if role is None:
            raise KeyError(f"the Megatron plan of {arch} has no row for {path} {shape}")
        spec = role_spec(role, len(shape), arch in CONV1D, kv_heads is None or kv_heads % mp == 0)
        for size, axis in zip(shape, spec):
            if axis and size % mp:
                raise ValueError(f"{arch}: {path} {shape} does not divide by {mp} on {spec}")
        out[path] = spec
    return out
