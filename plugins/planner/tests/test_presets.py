"""The published decoders by name (``redco_zoo_models.presets``): each builds abstractly with its
publisher's parameter count, ``redco plan --model <name>`` plans it, and a name the planner does
not know is refused with the names it does.

The parameter counts are read off abstract builds of the first few layers: the full count is
``c(1)`` plus, for each later layer, what a layer of its kind adds (``c(i + 1) - c(i)`` at the
first layer of that kind): Gemma 3's local and global layers hold the same parameters, a
hybrid's linear and full-attention layers do not, nor DeepSeek-V3's dense and MoE layers.
A full-depth ``nnx.eval_shape`` costs 2 to 30 s a model on 2 cores (tracing grows with the
square of the layers: each RNG-count update asks a tracer for its sharding and jax walks the
whole trace to word the answer), so only the CLI test builds one whole, the smallest."""
import jax
import pytest
from flax import nnx

from redco.cli import main
from redco.lora import trainable_mask
from redco_planner.commands import MODEL_HELP
from redco_planner.inspection import load_model
from redco_planner.models import zoo_preset
from redco_zoo_models.decoder import DecoderConfig, DecoderLM
from redco_zoo_models.presets import PRESETS, PUBLISHED_PARAMS, preset
from redco_zoo_models.runner import load_model as zoo_load_model

# The publishers' counts (PUBLISHED_PARAMS), and what the configs give: Llama 3.1-8B
# 8,030,261,248, 3.1-70B 70,553,706,496, 3.2-1B 1,235,814,400, 3.2-3B 3,212,749,824; Qwen3 0.6B
# 596,049,920 ... 32B 32,762,123,264 (cards round: 0.6B, 1.7B, 4.0B, 8.2B, 14.8B, 32.8B); Gemma 3
# 1B 999,885,952, 4B 3,880,263,168, 12B 11,766,034,176, 27B 27,009,346,304 (the report's text
# model: 1,000M, 3,884M, 11,771M, 27,016M); Phi-4-mini 3,836,021,760 (3.84B); MoE: see below;
# gpt-oss-20b 20,914,757,184 (the card's 20.91B); Qwen3.5-27B 26,895,998,464 and 35B-A3B
# 34,660,610,688 (language models; the cards' 27B and 35B add the vision tower), Qwen3-Next
# 79,674,391,296 (80B), OLMo 3 7,298,011,136 and 32,233,522,176, GLM-4.5-Air 106,852,251,264
# (106B), Llama-4-Scout 107,769,861,120 (the card's 109B has the vision tower), Gemma 4 31B
# 30,201,888,572 and 26B-A4B 25,175,468,062 (the cards' 30.7B and 25.2B).


def count(config: dict) -> int:
    cfg = DecoderConfig.from_hf(config)
    model = nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0)))
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def with_layers(config: dict, n: int) -> dict:
    """``config`` cut to its first ``n`` layers (and their layer types)."""
    out = {**config, "num_hidden_layers": n}
    if config.get("layer_types"):
        out["layer_types"] = config["layer_types"][:n]
    return out


def layer_kinds(config: dict, n: int) -> list[tuple]:
    """Each layer's kind: its type (attention, sliding, linear) and whether its MLP is dense
    (DeepSeek-V3 and GLM-4.5: the first ``first_k_dense_replace``); layers of one kind hold the
    same parameters."""
    types = config.get("layer_types") or [None] * n
    dense = config.get("first_k_dense_replace", 0)
    return [(types[i], i < dense) for i in range(n)]


@pytest.mark.parametrize("name", list(PRESETS))
def test_each_preset_has_its_published_parameter_count(name):
    config = preset(name)
    full = DecoderConfig.from_hf(config)  # the whole config reads (layer types, RoPE, window)
    kinds = layer_kinds(config, full.num_hidden_layers)
    first = {}  # each kind's first layer after the first: its parameters are c(i + 1) - c(i)
    for i, kind in enumerate(kinds[1:], 1):
        first.setdefault(kind, i)
    counts = {n: count(with_layers(config, n)) for n in range(1, max(first.values()) + 2)}
    per_layer = {kind: counts[i + 1] - counts[i] for kind, i in first.items()}
    total = counts[1] + sum(per_layer[kind] for kind in kinds[1:])
    assert abs(total / PUBLISHED_PARAMS[name] - 1) < 0.02, (name, total)
    assert name in MODEL_HELP  # redco plan --help names it


def test_the_presets_carry_their_families_switches():
    llama = DecoderConfig.from_hf(PRESETS["llama-3.2-1b"])
    assert llama.tie_word_embeddings and llama.rope.kind == "llama3"
    assert llama.rope.get("factor") == 32.0 and llama.head_dim == 64
    assert DecoderConfig.from_hf(PRESETS["llama-3.1-70b"]).rope.get("factor") == 8.0
    phi = DecoderConfig.from_hf(PRESETS["phi-4-mini"])
    assert (phi.rope.kind, phi.rope.rotary_dim, len(phi.rope.get("long_factor"))) == \
        ("longrope", 96, 48)
    gemma = DecoderConfig.from_hf(PRESETS["gemma-3-27b"])
    assert (gemma.query_pre_attn_scalar, gemma.sliding_window, gemma.local_rope.theta) == \
        (168, 1024, 10000.0)
    assert [gemma.sliding(i) for i in range(6)] == [True] * 5 + [False]
    assert DecoderConfig.from_hf(PRESETS["qwen3-8b"]).qk_norm == "head"
    assert preset("qwen3-8b") is not PRESETS["qwen3-8b"]  # a copy: callers may change it
    oss = DecoderConfig.from_hf(PRESETS["gpt-oss-20b"])
    assert (oss.attention_sinks, oss.router_bias, oss.expert_bias, oss.o_proj_bias) == (True,) * 4
    assert [oss.sliding(i) for i in range(4)] == [True, False] * 2 and oss.sliding_window == 128
    assert (oss.rope.kind, oss.rope.get("truncate"), oss.swiglu_limit) == ("yarn", False, 7.0)
    qwen = DecoderConfig.from_hf(PRESETS["qwen3-next-80b-a3b"])
    assert [qwen.mixer(i).value for i in range(4)] == ["gated_deltanet"] * 3 + ["attention"]
    assert (qwen.rope.rotary_dim, qwen.n_experts, qwen.shared_expert_gate) == (64, 512, True)
    assert DecoderConfig.from_hf(PRESETS["qwen3.5-27b"]).linear_num_value_heads == 48
    olmo = DecoderConfig.from_hf(PRESETS["olmo-3-32b"])
    assert [olmo.sliding(i) for i in range(4)] == [True] * 3 + [False]
    assert (olmo.rope.kind, olmo.local_rope.kind, olmo.norm_layout) == ("yarn", "default", "post")
    glm = DecoderConfig.from_hf(PRESETS["glm-4.5-air"])
    assert (glm.rope.rotary_dim, glm.attention_bias, glm.first_k_dense_replace) == (64, True, 1)
    scout = DecoderConfig.from_hf(PRESETS["llama-4-scout"])
    assert (scout.nope_layers[:2], scout.n_experts, scout.rope.get("factor")) == ((3, 7), 16, 16.0)
    assert all(scout.sparse(i) for i in range(48)) and scout.qk_norm == "l2"
    gemma4 = DecoderConfig.from_hf(PRESETS["gemma-4-26b-a4b"])
    assert [gemma4.sliding(i) for i in range(6)] == [True] * 5 + [False]
    assert (gemma4.k_eq_v, gemma4.n_experts, gemma4.sliding_window) == (True, 128, 1024)


def test_redco_plan_plans_a_preset(capsys):
    """With its 16 layers scanned (one compiled layer: 7 s of CPU, 37 s unrolled)."""
    main(["plan", "--model", "llama-3.2-1b", "--devices", "1", "--device-memory", "80GB",
          "--seq-len", "8", "--rules", "auto", "--compute-dtype", "bfloat16", "--scan_layers"])
    out = capsys.readouterr().out
    assert "llama-3.2-1b (layers stacked and scanned): 1 devices x 80GB" in out, out
    assert "bfloat16 compute" in out, out
    assert "pick: n_model_shards=1, n_context_shards=1, sharding_rules='auto'" in out, out


def test_an_unknown_name_is_refused_with_the_names(capsys):
    with pytest.raises(ValueError, match=r"Unknown model 'qwen3-9b': use one of .*qwen3-8b, "
                                         r"qwen3-14b.*phi-4-mini, mixtral-8x7b.*deepseek-v3, gpt-oss-20b.*"
                                         r"qwen3-next-80b-a3b, olmo-3-7b.*glm-4.5-air, .*"
                                         r"qwen2.5-vl-7b, qwen3-vl-8b.*llama-4-scout-vision, or "
                                         r"module:function"):
        load_model("qwen3-9b")
    with pytest.raises(SystemExit):
        main(["plan", "--model", "qwen3-9b", "--devices", "1", "--device-memory", "80GB"])
    assert "redco plan: Unknown model 'qwen3-9b'" in capsys.readouterr().err
    with pytest.raises(KeyError, match="No preset 'gemma-3-2b': the presets are .*gemma-3-1b"):
        preset("gemma-3-2b")


def test_a_preset_with_lora_and_the_zoo_cli_from_scratch():
    small = dict(num_hidden_layers=1, layer_types=["sliding_attention"], vocab_size=64)
    model = zoo_preset("gemma-3-1b", seq_len=8, **small)
    assert any(jax.tree.leaves(trainable_mask(model.lora(4).params)))  # native LoRA layers
    zoo, config = zoo_load_model("qwen3-0.6b", from_scratch=True, num_hidden_layers=1,
                                 vocab_size=64, hidden_size=32, intermediate_size=64,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    assert config["model_type"] == "qwen3" and zoo.cfg.qk_norm == "head"
    assert zoo.model.embed_tokens.embedding.shape == (64, 32)  # real weights, the overrides'
