"""Every dense family (``redco_zoo_models.toy.TINY_FAMILIES``: Llama 3.1/3.2, Qwen3, Gemma 2/3,
Phi-4-mini, OLMo 2/3, Mistral; SmolLM3's packed rows) gets what the zoo's LLaMA has: packed
rows, the chunked loss, context parallelism with its window and softcap, training through
``redco zoo run lm`` with tensor parallelism (and LoRA); and bad configs and checkpoints are
refused before compiling, naming what is wrong. Parity with transformers:
tests/zoo_parity/test_parity_families.py."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from redco import Deployer, sequence_split
from redco.cli import main
from redco_zoo_models import LlamaConfig, LlamaForCausalLM, from_pretrained, save_pretrained, split_model
from redco_zoo_models.hf import auto_class
from redco_zoo_models.toy import TINY_FAMILIES, WINDOW, tiny_family, word_tokenizer

TRAINED = ["llama-3.1", "llama-3.2", "qwen3", "gemma2", "gemma3", "phi-4-mini", "olmo2",
           "mistral", "olmo3"]


def forward(model):
    apply_fn, params = split_model(model)
    run = jax.jit(lambda p, ids, segments: apply_fn(p, ids, segment_ids=segments))
    return lambda ids, segments=None: np.asarray(run(params, ids, segments))


# The segment mask is one code path for every family: in CI the ones that differ in what a
# position sees (a window, local and global layers, partial rotary, NoPE); the Llama-style
# repeats run with REDCO_SLOW_TESTS=1.
PACKED = ["llama-3.1", "gemma2", "gemma3", "phi-4-mini", "smollm3", "gemma4"]


@pytest.mark.parametrize("family", [f if f in PACKED else pytest.param(f, marks=pytest.mark.slow)
                                    for f in TRAINED + ["smollm3", "gemma4"]])
def test_packed_documents_see_only_themselves(family):
    """Two documents in one row (12 and 20 tokens, both past the window): each one's logits are
    its own forward pass's (SmolLM3: a NoPE layer, sliding, among RoPE layers). Slow-tier
    families: the same mask as the CI ones (llama-3.1's for the Llama-style stacks)."""
    run = forward(tiny_family(family))
    ids = np.random.RandomState(0).randint(1, 63, (1, 32))
    segments = np.array([[1] * 12 + [2] * 20])
    packed = run(ids, segments)
    np.testing.assert_allclose(packed[:, :12], run(ids[:, :12]), atol=2e-5)
    np.testing.assert_allclose(packed[:, 12:], run(ids[:, 12:]), atol=2e-5)


@pytest.mark.parametrize("family", ["gemma2", "llama-3.2"])
def test_the_chunked_loss_equals_the_loss_of_whole_logits(family):
    """``labels=`` (chunks, never the whole logits) gives the cross-entropy of the model's own
    logits: Gemma 2's final softcap and Llama 3.2's tied head included."""
    apply_fn, params = split_model(tiny_family(family))
    ids = jnp.asarray(np.random.RandomState(1).randint(1, 63, (2, 24)))
    logits = jax.jit(apply_fn)(params, ids[:, :-1]).astype(jnp.float32)  # (eager: op by op)
    want = -jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], -1).mean()
    loss = jax.jit(lambda p: apply_fn(p, ids[:, :-1], labels=ids[:, 1:]))(params)
    np.testing.assert_allclose(loss, want, rtol=1e-5)


@pytest.mark.parametrize("family, strategy", [("gemma2", "ring"), ("gemma3", "all_gather"),
                                              ("phi-4-mini", "all_gather")])
def test_a_split_sequence_gives_the_unsplit_logits(family, strategy):
    """32 tokens over 4 devices (CP 4): windows (8) that cross devices, softcaps, local and
    global RoPEs, partial rotary, as on one device (gpt-oss's sinks: test_expert_parallel's
    training at CP 2)."""
    apply_fn, params = split_model(tiny_family(family))
    ids = jnp.asarray(np.random.RandomState(2).randint(1, 63, (2, 32)))
    whole = np.asarray(jax.jit(apply_fn)(params, ids))
    mesh = Deployer(jax_seed=0, n_context_shards=4, context_strategy=strategy, workdir=None,
                    verbose=False).mesh
    with sequence_split.splitting(mesh, strategy):  # (a new function: jit's cache is unsplit)
        split_fn = lambda p, ids: apply_fn(p, ids)  # noqa: E731
        assert "shard_map" in str(jax.make_jaxpr(split_fn)(params, ids))
        split = np.asarray(jax.jit(split_fn)(params, ids))
    np.testing.assert_allclose(split, whole, atol=2e-5)


# Qwen3-Next in two layers, every kind of its layers once: Gated DeltaNet with the MoE (stacked
# experts, router, gated shared expert), then gated attention with the dense MLP (its third layer
# repeats the first)
SHORTER = {"qwen3-next": dict(num_hidden_layers=2,
                              layer_types=["linear_attention", "full_attention"])}


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) for f in
                                    ("gemma3", "phi-4-mini", "qwen3-moe", "granite-4-h")] +
                         ["qwen3-next"])
def test_fsdp_with_tensor_parallelism_and_full_remat_trains_as_one_device(family):
    """Two updates at dp 4 x mp 2, FSDP, every layer rematerialised (Gemma 3's q/k norms, Phi's
    split fused projections, Qwen3-MoE's stacked experts and router, Granite 4's Mamba2 layers
    beside attention and its MoE with a shared MLP, Qwen3-Next's Gated DeltaNet tensors and gated
    shared expert): the params one device gets, to 1e-5. In CI Qwen3-Next, whose attention
    layers carry q/k norms and whose MoE stacked experts, a router and a gated shared MLP;
    Gemma 3, Phi and Qwen3-MoE (the same FSDP gather and remat over attention and experts) and
    Granite 4 (in CI: test_hybrid's test_its_experts_split_over_dp_train_as_on_one_device, at
    dp 4 x mp 2 FSDP with full remat) run with REDCO_SLOW_TESTS=1."""
    import optax

    from redco import Trainer
    from redco_zoo_lm import collate_fn, loss_fn
    rows = [{"token_ids": r} for r in np.random.RandomState(6).randint(1, 63, (8, 25))]

    def trained(**deployer):
        config = LlamaConfig.from_hf({**TINY_FAMILIES[family], **SHORTER.get(family, {})})
        apply_fn, params = split_model(LlamaForCausalLM(config, nnx.Rngs(0)))
        trainer = Trainer(Deployer(jax_seed=0, workdir=None, verbose=False, **deployer),
                          collate_fn, apply_fn, loss_fn, params, optax.sgd(0.5), remat="full")
        trainer.train_epoch(rows, 4 // trainer.deployer.dp_size, 0)
        return jax.device_get(trainer.params)

    one = trained(n_local_devices=1)
    many = trained(n_model_shards=2, sharding_rules="auto+fsdp")
    for a, b in zip(jax.tree.leaves(many), jax.tree.leaves(one)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_bf16_compute_stays_near_fp32():
    model = tiny_family("gemma2")
    ids = jnp.asarray(np.random.RandomState(3).randint(1, 63, (2, 16)))
    apply_fn, params = split_model(model)
    full = np.asarray(jax.jit(apply_fn)(params, ids))
    half = np.asarray(jax.jit(apply_fn)(jax.tree.map(lambda x: x.astype(jnp.bfloat16), params),
                                        ids)).astype(np.float32)
    assert np.abs(half - full).max() < 0.1 * np.abs(full).max()
    assert (half.argmax(-1) == full.argmax(-1)).mean() > 0.8


# Through the CLI: two families that differ in how a checkpoint is read and trained (full
# fine-tuning and LoRA, a sliding window with local and global layers, fused projections); each
# family's own reading is checked against transformers in tests/zoo_parity, a Llama through the
# CLI in test_lm.py, and the rest run here with REDCO_SLOW_TESTS=1.
THROUGH_THE_CLI = ["gemma3", "phi-4-mini"]


@pytest.mark.parametrize("family", [f if f in THROUGH_THE_CLI else
                                    pytest.param(f, marks=pytest.mark.slow) for f in TRAINED])
def test_each_family_trains_through_redco_zoo_run_lm(family, tmp_path):
    """``redco zoo run lm`` on a text file with 2 model shards (LoRA for every other family):
    the loss falls, and the saved directory is the same family with its token ids."""
    words = [f"w{i}" for i in range(60)]
    lines = np.random.RandomState(4).choice(words[:12], (60, 10))
    (tmp_path / "train.txt").write_text("\n".join(" ".join(line) for line in lines))
    model_dir = str(tmp_path / "model")
    save_pretrained(tiny_family(family), model_dir)
    word_tokenizer(words, ("<pad>", "<bos>", "<unk>")).save(os.path.join(model_dir,
                                                                         "tokenizer.json"))
    workdir = tmp_path / "run"
    lora = ["--lora_rank", "4"] if TRAINED.index(family) % 2 else []
    main(["zoo", "run", "lm", "--model", model_dir, "--train", str(tmp_path / "train.txt"),
          "--workdir", str(workdir), "--n_model_shards", "2", "--per_device_batch_size", "2",
          "--max_steps", "6", "--learning_rate", "3e-3", "--block_size", "16", *lora])
    losses = [json.loads(line)["train/loss"] for line in open(workdir / "metrics.jsonl")
              if '"train/loss"' in line]
    assert losses[-1] < losses[0], losses
    with open(workdir / "model" / "config.json") as f:
        saved = json.load(f)
    assert (saved["model_type"], saved["eos_token_id"]) == (TINY_FAMILIES[family]["model_type"],
                                                            63)
    trained = from_pretrained(auto_class(str(workdir / "model")), str(workdir / "model"))
    assert trained.cfg == tiny_family(family).cfg


def saved_family(tmp_path, family="qwen3", **config):
    """A tiny checkpoint of ``family`` with ``config`` changed in its config.json."""
    path = str(tmp_path / family)
    save_pretrained(tiny_family(family), path)
    with open(os.path.join(path, "config.json")) as f:
        written = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**written, **config}, f)
    return path


@pytest.mark.parametrize("family, change, named", [
    ("llama-3.1", {"rope_parameters": {"rope_type": "ntk-by-parts", "rope_theta": 1e4}},
     "RoPE type 'ntk-by-parts'"),
    ("llama-3.1", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}},
     "needs \\['high_freq_factor', 'low_freq_factor'\\]"),
    ("qwen3", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                   "beta_middle": 3}}, "beta_middle"),
    ("llama-3.1", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ("olmo2", {"sliding_window": 4096}, "sliding_window"),
    ("qwen3", {"num_experts": 8, "num_experts_per_tok": 2}, "num_experts"),
    ("gpt-oss", {"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config"),
    ("llama-3.1", {"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True,
                                           "bnb_4bit_quant_type": "nf4"}},
     r"bitsandbytes 4-bit checkpoint .*packed layout.*\.dequantize\(\)\.save_pretrained\(out\)"
     r".*--quantize_base nf4"),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("llama-3.1", {"attention_chunk_size": 8192}, "attention_chunk_size"),
    ("llama4", {"layer_types": ["chunked_attention", "sliding_attention", "full_attention"]},
     "layer_types \\['sliding_attention'\\]"),
    ("gemma3", {"model_type": "gemma4_text"}, "query_pre_attn_scalar"),  # (Gemma 3's scale)
    ("nemotron-h", {"layers_block_type": ["linear_attention", "sliding_attention", "mlp",
                                          "linear_attention", "full_attention", "moe"]},
     "layers_block_type \\['sliding_attention'\\]"),
    ("llama-3.1", {"mlp_bias": True, "unsloth_version": "2026.11.1"}, "\\['mlp_bias'\\]"),
    ("phi-4-mini", {"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0],
                                        "long_factor": [1.0, 2.0, 3.0]}}, "short_factor has 1"),
])
def test_a_config_the_family_cannot_honour_is_refused_naming_the_field(tmp_path, family, change,
                                                                       named):
    path = saved_family(tmp_path, family, **change)
    with pytest.raises(ValueError, match=named) as e:
        from_pretrained(auto_class(path), path)
    assert path in str(e.value)


UNSLOTH = {"unsloth_version": "2026.11.1", "unsloth_fixed": True, "notes": "merged 16-bit",
           "_name_or_path": "/home/me/outputs", "torch_dtype": "bfloat16",
           "architectures": ["LlamaForCausalLM"]}


def test_an_unsloth_save_loads_with_one_warning_naming_its_metadata(tmp_path):
    """Keys no transformers class reads are metadata: one warning names them all, and the
    model is the one without them; computation keys at their no-op value pass silently."""
    plain = from_pretrained(auto_class(path := saved_family(tmp_path, "llama-3.1")), path)
    path = saved_family(tmp_path, "llama-3.1", mlp_bias=False, sliding_window=None, **UNSLOTH)
    with pytest.warns(UserWarning) as caught:
        model = from_pretrained(auto_class(path), path)
    named = [str(w.message) for w in caught if "config.json" in str(w.message)]
    assert len(named) == 1, named
    assert "['notes', 'unsloth_fixed', 'unsloth_version']" in named[0]
    assert model.cfg == plain.cfg


def test_tensors_missing_or_left_over_are_refused_naming_them(tmp_path):
    path = saved_family(tmp_path, "qwen3")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    extra = {**tensors, "model.layers.0.mlp.experts.0.up_proj.weight": np.zeros((4, 4))}
    save_file(extra, os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match="experts.0.up_proj"):
        from_pretrained(auto_class(path), path)
    missing = {k: v for k, v in tensors.items() if "layers.1.self_attn.q_norm" not in k}
    save_file(missing, os.path.join(path, "model.safetensors"))
    with pytest.raises(KeyError, match="model.layers.1.self_attn.q_norm.weight"):
        from_pretrained(auto_class(path), path)
    buffers = {**tensors, "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32)}
    save_file(buffers, os.path.join(path, "model.safetensors"))
    from_pretrained(auto_class(path), path)  # a rotary buffer is harmless


@pytest.mark.parametrize("family, dropped", [("glm4-moe", True), ("qwen3-moe", False)])
def test_multi_token_prediction_layers_are_dropped_where_the_family_has_them(tmp_path, family,
                                                                             dropped):
    """GLM-4.5's and DeepSeek-V3's checkpoints carry their MTP layer after the model's (GLM-4.5's
    ``model.layers.92``): read without it, as transformers reads them; elsewhere a layer past
    the model's is refused."""
    path = saved_family(tmp_path, family)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    n = TINY_FAMILIES[family]["num_hidden_layers"]
    mtp = {f"model.layers.{n}.{k.split('.', 3)[3]}": v for k, v in tensors.items()
           if k.startswith("model.layers.1.")}
    save_file({**tensors, **mtp}, os.path.join(path, "model.safetensors"))
    if dropped:
        loaded = from_pretrained(auto_class(path), path)
        assert loaded.cfg == tiny_family(family).cfg
    else:
        with pytest.raises(ValueError, match=f"model.layers.{n}."):
            from_pretrained(auto_class(path), path)


def test_a_window_the_decoder_honours_changes_what_it_computes():
    """Mistral's window is read, not dropped: past it the logits differ from no window."""
    from redco_zoo_models import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig.from_hf(TINY_FAMILIES["mistral"])
    assert cfg.sliding_window == WINDOW
    ids = jnp.asarray(np.random.RandomState(5).randint(1, 63, (1, 20)))
    import dataclasses

    def logits(cfg):  # (jitted: eager, each op compiles)
        apply_fn, params = split_model(LlamaForCausalLM(cfg, nnx.Rngs(0)))
        return jax.jit(apply_fn)(params, ids)
    windowed = logits(cfg)
    unwindowed = logits(dataclasses.replace(cfg, sliding_window=None))
    np.testing.assert_allclose(windowed[:, :WINDOW], unwindowed[:, :WINDOW], atol=1e-5)
    assert np.abs(windowed[:, WINDOW:] - unwindowed[:, WINDOW:]).max() > 1e-3


@pytest.mark.parametrize("family", TRAINED + ["gemma4"])
def test_no_param_is_weakly_typed(family):
    """A weakly typed param (``jnp.full(shape, 1.0)``) becomes strong after the first update,
    and the train step compiles again at step 2 (seen: a multihost watchdog firing)."""
    params = nnx.state(tiny_family(family), nnx.Param)
    assert not [p for p, x in jax.tree_util.tree_leaves_with_path(params)
                if jax.typeof(x).weak_type]
