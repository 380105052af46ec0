"""The dense families people fine-tune in 2026 against transformers' PyTorch models, one test per
property, parametrized over the families: Llama 3.1 (``llama3`` RoPE, factor 8) and 3.2 (factor
32, tied head, explicit head_dim), Qwen3 (q/k norm), Gemma 2 (softcaps, every other layer
sliding), Gemma 3 (local/global layers, a RoPE each, scaled global RoPE), Phi-3/4 (fused
projections, partial rotary, longrope), OLMo 2 (post-norms, q/k norm over all heads), Mistral
(a window on every layer), Qwen3-MoE (a dense layer between sparse ones, per-expert tensors) and
Mixtral (its own expert names), DeepSeek-V3 (multi-head latent attention with YaRN's mscale and
interleaved RoPE, dense first layer, sigmoid routing limited to 2 of 4 groups with a random
balancing bias, shared experts; and a variant without the query latent, RoPE in halves),
gpt-oss (attention sinks, biases on attention, router and experts, interleaved gate/up experts
with a clamped SwiGLU whose limit the tiny model reaches, every other layer sliding, YaRN
without truncation), OLMo 3 (OLMo 2's norms, a window and a RoPE per layer type, YaRN with an
``attention_factor``), SmolLM3 (a NoPE layer, sliding), Seed-OSS (biases on all four attention
projections), GLM-4.5 (DeepSeek-V3's routing and shared expert on GQA with per-head q/k norms
and half-rotary heads), MiniMax-M2 (sigmoid routing with a balancing bias on every layer, q/k
norms over all heads, ``rotary_dim``), Granite 4 hybrid (Mamba2 layers beside attention, chunks
of 8 and a conv of 4 that the prompts cross, its four multipliers, MoE with a shared MLP and
NoPE; a dense variant with RoPE and biased Mamba2 projections), Llama 4 (chunks of 8 on its
RoPE layers, a temperature-tuned NoPE layer, top-2 input-scaled experts beside a shared one:
more in test_parity_llama4), Gemma 4 (per-layer inputs, KV sharing, double-wide MLPs, full
layers of their own head size with proportional RoPE, and the MoE block beside every MLP: its
normed and scaled router, top-2 of 4 renormalised and scaled per expert, packed experts: more
in test_parity_gemma4), Falcon-H1 (attention and Mamba2 side by side in every layer,
chunks of 8 and a conv of 4 that the prompts cross, mamba_d_ssm apart from expand * hidden,
every muP multiplier off 1, at 1e-4; a variant with the plain gate and biased projectors),
Nemotron-H (one block a layer: Mamba2 with biased projections, NoPE attention, relu2 MLPs, an
MoE block of ungated experts behind a latent projection with a shared expert and scaled
sigmoid routing, at 1e-4; its M- pair stacked twice when scanned), and YaRN and dynamic-NTK
RoPE on Qwen3 and LLaMA shapes.

Each tiny checkpoint is written by transformers itself (``from_config`` + ``save_pretrained``,
weights perturbed so a misplaced one shows, sharded so the index is read). The lengths cross
every sliding window (8) and every RoPE's ``original_max_position_embeddings`` (16). Each
family's forward compiles once a shape for all of its checks (``jitted``). Left padding,
generation and the sampler's log-probs run in CI on the families that take distinct code paths
there (``SAMPLER_PATHS``, ``GREEDY_PATHS``); the others' cases are slow-tier repeats."""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import NamedSharding
from parity import close, hf_greedy, jiggle_torch, left_padded, transformers

from redco.sharding import make_mesh, specs_from_rules
from redco.tree_paths import named_leaves
from redco_zoo_models import from_pretrained, generate, save_pretrained
from redco_zoo_models.balancing import BalanceBias
from redco_zoo_models.expert_parallel import EXPERT_WEIGHTS, expert_parallel, sharding_rules
from redco_zoo_models.hf import auto_class
from redco_zoo_models.toy import DELTA_NET_FAMILIES, TINY_FAMILIES

VOCAB, EOS, PAD, BOS = 64, 63, 0, 1
GEMMA4_MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2,  # (the 26B-A4B's
                  moe_intermediate_size=8)  # block beside each MLP, in every check of gemma4 here)
FAMILIES = {k: dict(v, **GEMMA4_MOE) if k == "gemma4" else v  # the lengths below cross WINDOW
            for k, v in TINY_FAMILIES.items()  # (8) and ORIGINAL_CONTEXT (16); Gated DeltaNet:
            if k not in DELTA_NET_FAMILIES}  # its own file
LOGITS_ONLY = {"qwen3-yarn", "deepseek-v3-plain-q", "seed-oss"}  # logits and export only
FALCON = {"falcon-h1": 1e-4, "falcon-h1-plain-gate": 1e-4, "nemotron-h": 1e-4}  # (the bound)
ATOL = {**FALCON, "gemma4": 2e-3}  # unit-scale attention over normed q/k: an ill-conditioned tiny model.
#   From transformers in float64, 40 tokens: float32 transformers 3e-5..1.4e-4, ours 9e-5..2.7e-4
#   with XLA's default flags, 7e-4..1.1e-3 under CI's (-O0): its float32 kernels round worse


_FORWARDS = {}  # a model's graph -> its forward compiled: one per family (and variant)


def jitted(model):
    """``model(ids, attention_mask=None)`` compiled (eager NNX runs op by op), once per graph:
    every check of a family (and a variant differing only in its weights) reuses the programs
    compiled for its shapes."""
    graphdef, state = nnx.split(model)
    if graphdef not in _FORWARDS:
        _FORWARDS[graphdef] = jax.jit(lambda state, ids, mask: nnx.merge(graphdef, state)(
            ids, attention_mask=mask))
    return lambda ids, attention_mask=None: _FORWARDS[graphdef](
        state, jnp.asarray(ids), attention_mask)


def in_ci(paths):
    """``pair``'s families, those outside ``paths`` (a property's distinct code paths) marked
    slow: repeats of a path a family in ``paths`` takes."""
    return [f if f in paths else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES]


def generating(family):
    if family in LOGITS_ONLY:
        pytest.skip("logits and export only (what it generates with, others test)")


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    """``(transformers' model, its directory, ours read from it)`` for a family."""
    config = dict(FAMILIES[request.param])
    config = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
    torch.manual_seed(0)
    theirs = random_buffers(jiggle_torch(transformers.AutoModelForCausalLM.from_config(
        config)))
    path = str(tmp_path_factory.mktemp(request.param))
    theirs.save_pretrained(path, max_shard_size="40KB")  # several files and an index
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    return theirs, path, from_pretrained(auto_class(path), path), request.param


def random_buffers(model):
    """The stored buffers ``jiggle_torch`` leaves as they start: DeepSeek-V3's routers'
    ``e_score_correction_bias`` (0) drawn at the scale of the sigmoid scores, so that it changes
    the choice; Gemma 4's ``layer_scalar`` (1) drawn around 1."""
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.copy_(
                    0.3 * torch.randn_like(module.e_score_correction_bias))
            if hasattr(module, "layer_scalar"):
                module.layer_scalar.copy_(1 + 0.3 * torch.randn_like(module.layer_scalar))
    return model


def fresh_rope(model):
    """transformers' dynamic-NTK RoPE keeps the longest length it has seen across calls; start
    each comparison from none seen (ours computes each call's frequencies from the call)."""
    rotary = getattr(model.model, "rotary_emb", None)
    if rotary is not None and "dynamic" in rotary.rope_type:  # (None: NoPE, Granite 4;
        #                                                       none at all: Nemotron-H)
        rotary.inv_freq.copy_(rotary.original_inv_freq)
        rotary.max_seq_len_cached = rotary.original_max_seq_len
    return model


def torch_logits(model, ids, **inputs):
    fresh_rope(model)
    with torch.no_grad():
        out = model(torch.tensor(np.asarray(ids)),
                    **{k: torch.tensor(np.asarray(v)) for k, v in inputs.items()})
    return out.logits.numpy()


def test_logits_equal_transformers_at_two_lengths(pair):
    """12 tokens: within the window and the original context; 40: past both."""
    theirs, _, ours, family = pair
    forward = jitted(ours)
    for n in (12, 40):
        ids = np.random.RandomState(n).randint(1, EOS, (2, n))
        close(forward(ids), torch_logits(theirs, ids), ATOL.get(family, 5e-4))


# The families whose padding is read differently (a causal mask, local/global windows, MLA's
# latent, Mamba2 zeroing the padding beside attention or in every layer, shared KV layers, sinks,
# a RoPE that changes with the length, Nemotron-H's layers of one block, the MLP ones without a
# cache); the rest repeat one of them and run in the slow tier only.
SAMPLER_PATHS = ("llama-3.1", "gemma3", "deepseek-v3", "granite-4-h", "falcon-h1", "gemma4",
                 "gpt-oss", "llama-dynamic", "nemotron-h")
# Decoding also switches longrope's factors as the cache grows past the original context
# (Phi-4-mini) and masks Llama 4's chunks of 8 over the cache.
GREEDY_PATHS = SAMPLER_PATHS + ("phi-4-mini", "llama4")


@pytest.mark.parametrize("pair", in_ci(SAMPLER_PATHS), indirect=True)
def test_left_padded_logits_equal_transformers(pair):
    """Prompts behind 0-3 pads (a hybrid's Mamba2 layers zero the padding as transformers').
    The families outside ``SAMPLER_PATHS`` are slow-tier repeats: in CI each one's forward is
    guarded by test_logits_equal_transformers_at_two_lengths, and its padding by the family of
    ``SAMPLER_PATHS`` that masks the same way."""
    theirs, _, ours, family = pair
    generating(family)
    ids, mask = left_padded(3, 20, EOS, PAD, seed=3)
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    got = jitted(ours)(ids, attention_mask=jnp.asarray(mask))
    want = torch_logits(theirs, ids, attention_mask=mask, position_ids=positions)
    close(got * mask[..., None], want * mask[..., None])  # padding rows are don't-cares


@pytest.mark.parametrize("pair", in_ci(GREEDY_PATHS), indirect=True)
def test_greedy_generation_equals_transformers(pair):
    """Prompts behind 0-3 pads, 24 new tokens: the cache crosses the window and the original
    context while generating. The families outside ``GREEDY_PATHS`` are slow-tier repeats: in
    CI each one's layers are guarded by test_logits_equal_transformers_at_two_lengths, and its
    decoding by the family of ``GREEDY_PATHS`` whose cache it shares."""
    theirs, _, ours, family = pair
    generating(family)
    prompts, mask = left_padded(4, 6, EOS, PAD, seed=4)
    got = jax.jit(lambda params, prompts, mask: generate(
        ours, params, prompts, 24, prompt_mask=mask, eos_token_id=EOS, pad_token_id=PAD))(
        nnx.state(ours, nnx.Param), jnp.asarray(prompts), jnp.asarray(mask))
    want = hf_greedy(fresh_rope(theirs), prompts, 6, 24, EOS, PAD, attention_mask=mask)
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("pair", in_ci(SAMPLER_PATHS), indirect=True)
def test_sampler_logprobs_equal_a_training_forward(pair):
    """What ``generate`` reports for each sampled token is what a forward pass over the prompt
    and the completion computes (RL's ratio starts at 1). A RoPE whose frequencies change with
    the length (longrope, dynamic) gives early tokens other frequencies in a forward over a
    longer whole, in transformers too: there the sequence stays within the original context.
    The families outside ``SAMPLER_PATHS`` (whose caches decode differently: the KV cache,
    local/global windows, MLA's latent, Mamba2's state beside attention or in every layer, shared
    KV layers, sinks, a RoPE that changes with the length) are slow-tier repeats; in CI this
    property is guarded by the family of ``SAMPLER_PATHS`` that decodes the same way."""
    _, _, ours, family = pair
    generating(family)
    n_new = 8 if ours.cfg.rope.kind in ("longrope", "dynamic") else 20
    prompts = np.random.RandomState(5).randint(1, EOS, (2, 6))
    tokens, logprobs = jax.jit(lambda params, prompts: generate(
        ours, params, prompts, n_new, rng=jax.random.PRNGKey(1), temperature=1.0,
        return_logprobs=True))(nnx.state(ours, nnx.Param), jnp.asarray(prompts))
    whole = jnp.concatenate([jnp.asarray(prompts), tokens], 1)
    forward = jax.nn.log_softmax(jitted(ours)(whole)[:, 5:-1].astype(jnp.float32))
    want = jnp.take_along_axis(forward, tokens[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(logprobs), np.asarray(want), atol=2e-4)


def test_export_loads_in_transformers_with_the_same_logits_and_token_ids(pair, tmp_path):
    """Ours written back: transformers reads every tensor (none missing or left over), gives the
    same logits, and its plain ``generate()`` stops at the config's EOS."""
    theirs, _, ours, _ = pair
    save_pretrained(ours, str(tmp_path))
    model_class = type(theirs)
    back, info = model_class.from_pretrained(str(tmp_path), output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ids = np.random.RandomState(6).randint(1, EOS, (2, 40))
    close(torch_logits(back.eval(), ids), torch_logits(theirs, ids))
    with open(tmp_path / "generation_config.json") as f:
        assert json.load(f)["eos_token_id"] == EOS
    assert (back.generation_config.eos_token_id, back.generation_config.pad_token_id) == (EOS, PAD)
    assert back.config.bos_token_id == BOS


SCANNED = ("llama-3.1", "gemma3", "mixtral", "nemotron-h")  # a stack of 3; sliding pattern
#  (2 stacked, 2 alone); MoE with per-expert tensors; Nemotron-H's blocks (M- stacked twice)


def test_scanned_layers_read_and_write_transformers_checkpoints(pair, tmp_path):
    """The checkpoint read with its layers stacked (``scan_layers``) gives transformers' logits,
    and written back, transformers reads it whole with the same logits."""
    theirs, path, _, family = pair
    if family not in SCANNED:
        pytest.skip("scanned variants of a few families only")
    ours = from_pretrained(auto_class(path), path, scan_layers=True)
    assert any(":" in p for p, _ in named_leaves(nnx.state(ours, nnx.Param)))
    ids = np.random.RandomState(7).randint(1, EOS, (2, 40))
    want = torch_logits(theirs, ids)
    close(jitted(ours)(ids), want)
    save_pretrained(ours, str(tmp_path))
    back, info = type(theirs).from_pretrained(str(tmp_path), output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    close(torch_logits(back.eval(), ids), want)


def test_deepseek_v3s_logits_are_within_1e4_where_its_routing_limits_matter(pair):
    """DeepSeek-V3's logits equal transformers' within 1e-4 (fp32), and there its routing
    limits take effect: without the group limit (every group kept) or without the loaded
    balancing bias, other experts are chosen and the logits differ."""
    theirs, _, ours, _ = pair
    if ours.cfg.topk_group == ours.cfg.n_group:
        pytest.skip("no group limit in this family")
    ids = np.random.RandomState(40).randint(1, EOS, (2, 40))
    np.testing.assert_allclose(jitted(ours)(ids), torch_logits(theirs, ids), atol=1e-4)
    ungrouped = type(ours)(dataclasses.replace(ours.cfg, topk_group=ours.cfg.n_group),
                           nnx.Rngs(0))
    nnx.update(ungrouped, nnx.state(ours, nnx.Param))
    unbiased = nnx.clone(ours)
    nnx.update(unbiased, jax.tree.map(jnp.zeros_like, nnx.state(ours, BalanceBias)))
    for other in (ungrouped, unbiased):
        assert np.abs(jitted(other)(ids) - jitted(ours)(ids)).max() > 1e-2


def test_gpt_oss_logits_are_within_1e4_where_each_of_its_switches_matters(pair):
    """gpt-oss's logits (40 tokens, past its window of 8) equal transformers' within 1e-4 (fp32),
    and each of its switches changes them there: without the attention sinks (a sink of -1e9
    takes no share), the router's bias, the experts' biases or the SwiGLU's clamp (a limit no
    value reaches) they differ."""
    theirs, _, ours, _ = pair
    if not ours.cfg.attention_sinks:
        pytest.skip("not gpt-oss")
    ids = jnp.asarray(np.random.RandomState(40).randint(1, EOS, (2, 40)))
    graphdef, params = nnx.split(ours, nnx.Param)
    forward = jax.jit(lambda params: nnx.merge(graphdef, params)(ids))  # (compiled once)
    want = forward(params)
    np.testing.assert_allclose(want, torch_logits(theirs, ids), atol=1e-4)

    def with_params(suffix: str, value: float):
        return jax.tree.unflatten(jax.tree.structure(params), [
            jnp.full_like(x, value) if path.endswith(suffix) else x
            for path, x in named_leaves(params)])
    unclamped = type(ours)(dataclasses.replace(ours.cfg, swiglu_limit=1e9), nnx.Rngs(0))
    nnx.update(unclamped, params)
    variants = {"no sinks": forward(with_params("self_attn/sinks", -1e9)),
                "no router bias": forward(with_params("mlp/gate/bias", 0.0)),
                "no expert biases": forward(with_params("_bias", 0.0)),
                "no clamp": jitted(unclamped)(ids)}
    for name, logits in variants.items():
        assert np.abs(logits - want).max() > 1e-2, name


def check_routers(ours, theirs):
    """Each layer's MoE router in ours picks transformers' experts for 24 random tokens, with
    its weights (1e-5)."""
    x = np.random.RandomState(8).randn(24, ours.cfg.hidden_size).astype(np.float32)
    for mine, layer in zip(ours.model.layers, theirs.model.layers):
        chosen, weights, _, _ = mine.moe.route(jnp.asarray(x))
        with torch.no_grad():
            _, want_weights, want_chosen = layer.router(torch.tensor(x))
        np.testing.assert_array_equal(chosen, want_chosen.numpy())
        np.testing.assert_allclose(weights, want_weights.numpy(), rtol=1e-5, atol=1e-6)


def test_gemma4s_moe_block_routes_as_transformers_and_runs_expert_parallel(pair):
    """Gemma 4's MoE block beside the MLP. Each layer's router (its weightless norm and
    learned scale, softmax, the top-k renormalised, each expert's scale) picks transformers'
    experts with transformers' weights: the logits alone cannot show the renormalisation
    (the block's output is RMS-normed next, so a per-token factor on its weights cancels).
    Expert-parallel: the decoder hands its experts to ``as_laid_out`` (``moe_weights``, as the
    ``+ep`` rule sets' steps read them), and with them split over dp 4
    (``expert_parallel.sharding_rules``) each token is sent to its experts' devices
    (``all_to_all``) and the 40-token logits are transformers'."""
    theirs, _, ours, family = pair
    if not ours.cfg.moe_beside_mlp:
        pytest.skip("no MoE block beside the MLP in this family")
    check_routers(ours, theirs)
    experts = [p for p, _ in ours.model.moe_weights() if EXPERT_WEIGHTS.search(p)]
    assert len(experts) == 3 * ours.cfg.num_hidden_layers, experts
    mesh = make_mesh(jax.devices()[:4], 1)
    graphdef, state = nnx.split(ours)
    specs = specs_from_rules(state, sharding_rules(), mesh)
    state = jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    ids = jnp.asarray(np.random.RandomState(40).randint(1, EOS, (2, 40)))
    with expert_parallel(mesh):
        lowered = jax.jit(lambda state: nnx.merge(graphdef, state)(ids)).lower(state)
    assert "all_to_all" in lowered.as_text()
    close(lowered.compile()(state), torch_logits(theirs, ids), ATOL[family])


OLDER = {  # config.json in the layout before transformers 5: rope_scaling, rope_theta at the top
    "llama-3.1": dict(FAMILIES["llama-3.1"], rope_parameters=None, rope_theta=500000.0,
                      rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                        high_freq_factor=4.0,
                                        original_max_position_embeddings=16)),
    "phi-3.5": dict(FAMILIES["phi-3-window"], sliding_window=None, rope_theta=10000.0,
                    partial_rotary_factor=0.5, original_max_position_embeddings=16,
                    rope_scaling=dict(type="longrope", short_factor=[1.0, 1.2],
                                      long_factor=[3.0, 4.0])),
    "gemma3": dict(FAMILIES["gemma3"], rope_parameters=None, layer_types=None, rope_theta=1e6,
                   rope_local_base_freq=1e4, sliding_window_pattern=2,
                   rope_scaling=dict(rope_type="linear", factor=8.0)),
    "olmo3": dict(FAMILIES["olmo3"], rope_parameters=None, layer_types=None, num_hidden_layers=4,
                  rope_scaling=dict(rope_type="yarn", factor=4.0, attention_factor=1.2,
                                    original_max_position_embeddings=16)),  # (theta: 5e5)
    "smollm3": dict(FAMILIES["smollm3"], rope_parameters=None, rope_theta=5e6, layer_types=None,
                    no_rope_layers=None, no_rope_layer_interval=2),
    "glm4-moe": dict(FAMILIES["glm4-moe"], rope_parameters=None, rope_theta=1e6),  # (half)
    "minimax-m2": dict(FAMILIES["minimax-m2"], rope_parameters=None, rope_theta=5e6),
    "gemma4": dict(FAMILIES["gemma4"], layer_types=None, rope_parameters=None,  # (5 sliding : 1
                   num_kv_shared_layers=None, use_double_wide_mlp=None),  # full, the last full)
}


@pytest.mark.parametrize("name", OLDER)
def test_the_older_rope_scaling_layout_reads_as_transformers_reads_it(name, tmp_path):
    """A hand-written config.json in the older layout (``rope_scaling``; Phi's top-level
    ``partial_rotary_factor``, Gemma 3's ``rope_local_base_freq`` and window pattern, OLMo 3's
    and SmolLM3's default layer types, SmolLM3's NoPE interval, GLM-4.5's default half-rotary
    heads, MiniMax-M2's ``rotary_dim``; Gemma 4's hub layout, ``global_head_dim`` without
    ``per_layer_config``, default layer types and RoPEs; rms_norm_eps left to the family's
    default): the logits of transformers reading it."""
    config = {k: v for k, v in OLDER[name].items() if v is not None and k != "rms_norm_eps"}
    torch.manual_seed(0)
    made = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(
        config["model_type"], **{k: v for k, v in config.items() if k != "model_type"}))
    jiggle_torch(made).save_pretrained(str(tmp_path))
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config, f)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    ours = jitted(from_pretrained(auto_class(str(tmp_path)), str(tmp_path)))
    # 40 tokens: past the original context (16), each position's RoPE as a shorter call's;
    # longrope's factors switch with the call's length: also a call within it
    for n in (10, 40) if name == "phi-3.5" else (40,):
        ids = np.random.RandomState(n).randint(1, EOS, (2, n))
        close(ours(ids), torch_logits(theirs, ids), ATOL.get(name, 5e-4))
