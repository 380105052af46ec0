"""QLoRA (``redco_zoo_models.quantize``, ``quantized_linear``): the NF4 code book is the 16 values
published with QLoRA (bitsandbytes' ``get_4bit_type("nf4")``, written out here); NF4 codes pack
two a byte, blocks of 64 scale by their absmax and the absmaxes double-quantise in blocks of 256;
each format's quantise -> dequantise error stays inside its bound (NF4: absmax x the code book's
largest half-gap plus the absmax's own 8-bit error; int8: absmax / 254; fp8 e4m3: the cast
ml_dtypes makes, relative error <= 2^-4 on normal values); LoRA over an NF4 base learns a Markov
chain to within 2% of the loss the same run reaches over the full-precision base (measured,
written out against the chain's entropy rate); dp 4 x mp 2
gives one device's adapters and loss, the codes and their scales split on the same mesh axis, and
so does dp 2 x cp 2 x mp 2 (context parallel, FSDP) with every layer rematerialised;
``redco zoo run sft --quantize_base`` refuses to run without LoRA and saves a plain merged model."""
import math
import re

import jax
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx
from safetensors.numpy import load_file
from test_lm import markov_chain, sample_chains
from test_sft import SPECIALS, WORDS, chat_tokenizer, write_chats

from redco import Deployer, Trainer, layer_stacks, lora, remat
from redco.cli import main
from redco.tree_paths import named_leaves
from redco_zoo_lm import collate_fn, loss_fn
from redco_zoo_models import LlamaConfig, LlamaForCausalLM, add_lora, from_pretrained, split_model
from redco_zoo_models import quantize as q
from redco_zoo_models.hf import save_pretrained
from redco_zoo_models.quantized_linear import sharding_rules
from redco_zoo_models.toy import save_model_dir, tiny_llama

PUBLISHED_NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                 -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                 0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                 0.7229568362236023, 1.0]


def test_the_nf4_code_book_is_the_one_published_with_qlora():
    np.testing.assert_allclose(q.NF4, PUBLISHED_NF4, rtol=0, atol=1e-6)  # (float32 quantiles)


def test_nf4_packs_two_codes_a_byte_and_scales_blocks_of_64_by_their_absmax():
    """Values on the code book times 2.5, each block holding a +-1 code: the codes come back as
    the indices (row 2i low nibble, 2i+1 high), the weights exactly (every absmax is 2.5, so
    the double quantisation has nothing to round), one absmax per 64 rows and one float32 scale
    per 256 of them along the output axis."""
    idx = np.random.default_rng(0).integers(0, 16, (128, 512))
    idx[[0, 64]] = 15
    w = (2.5 * np.asarray(PUBLISHED_NF4, np.float32)[idx]).astype(np.float32)
    parts = {k: np.asarray(v) for k, v in q.quantize(w, "nf4").items()}
    assert parts["codes"].dtype == np.uint8 and parts["codes"].shape == (64, 512)
    np.testing.assert_array_equal(parts["codes"] & 15, idx[0::2])
    np.testing.assert_array_equal(parts["codes"] >> 4, idx[1::2])
    assert parts["absmax"].shape == (2, 512) and parts["absmax_scale"].shape == (2, 2)
    np.testing.assert_allclose(np.asarray(q.dequantize(parts, "nf4")), w, rtol=0, atol=1e-6)


def heavy_tailed(shape, seed=0):
    """Student-t weights (a few large ones, as trained kernels have), one column all zero."""
    w = np.random.default_rng(seed).standard_t(4, shape).astype(np.float32) * 0.05
    w[:, 3] = 0
    return w


def nf4_bound(w):
    """Per weight: its block's absmax x the code book's largest half-gap, plus the absmax's own
    error from its 8 bits (linear, in groups of 256 along the output axis: max |c - mean| / 254)."""
    absmax = np.abs(w.reshape(-1, 64, w.shape[1])).max(1)
    centred = absmax - absmax.mean()
    group = math.gcd(w.shape[1], 256)
    per_group = np.abs(centred.reshape(len(absmax), -1, group)).max(-1) / 254
    absmax_error = np.repeat(per_group, group, axis=1)
    half_gap = np.max(np.diff(PUBLISHED_NF4)) / 2
    return np.repeat(absmax * half_gap + absmax_error, 64, axis=0)


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_nf4_and_int8_quantise_dequantise_errors_are_within_their_bounds(fmt):
    w = heavy_tailed((256, 384))
    err = np.abs(np.asarray(q.dequantize(q.quantize(w, fmt), fmt)) - w)
    bound = nf4_bound(w) if fmt == "nf4" else np.broadcast_to(np.abs(w).max(0) / 254, w.shape)
    assert np.all(err <= bound * (1 + 1e-5) + 1e-8), (err / bound).max()
    assert (err / np.maximum(bound, 1e-12)).max() > 0.4  # a bound the errors come near


def test_fp8_is_the_e4m3_cast_of_the_scaled_weights_within_2_to_the_minus_4():
    """The codes are ml_dtypes' cast of ``w / (absmax / 448)`` per output channel; on normal
    values (|scaled| >= 2^-6) the relative error is at most 2^-4 (3 mantissa bits, rounded)."""
    w = heavy_tailed((256, 384))
    parts = q.quantize(w, "fp8")
    absmax = np.abs(w).max(0)
    scaled = w / np.where(absmax > 0, absmax / 448, 1)
    np.testing.assert_array_equal(np.asarray(parts["codes"]).astype(np.float32),
                                  scaled.astype(ml_dtypes.float8_e4m3fn).astype(np.float32))
    normal = np.abs(scaled) >= 2.0 ** -6
    assert normal.mean() > 0.9
    relative = np.abs(np.asarray(q.dequantize(parts, "fp8")) - w)[normal] / np.abs(w[normal])
    assert 2.0 ** -5 < relative.max() <= 2.0 ** -4 * (1 + 1e-6), relative.max()


MARKOV = LlamaConfig(vocab_size=16, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, initializer_range=128 ** -0.5)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A random LLaMA saved as a HuggingFace directory, the frozen base of each run."""
    path = str(tmp_path_factory.mktemp("qlora") / "base")
    save_pretrained(LlamaForCausalLM(MARKOV, nnx.Rngs(0)), path)
    return path


def lora_trainer(base, fmt, n_rows, batch=8, lr=1e-2, remat_policy=None, scan=False,
                 **deployer):
    """A LoRA (rank 4) trainer over ``base`` quantised as ``fmt`` (None: full precision), laid
    out as ``redco zoo run`` lays it out, its layers rematerialised by ``remat_policy``;
    ``scan``: the layers stacked and scanned."""
    model = add_lora(from_pretrained(LlamaForCausalLM, base, quantize=fmt,
                                     scan_layers=scan),
                     rank=4, alpha=16.0)
    apply_fn, params = split_model(model)
    deployer = Deployer(jax_seed=0, workdir=None, verbose=False, **deployer)
    rules = deployer.get_sharding_rules(params, rules=sharding_rules(model, deployer))
    schedule = deployer.get_lr_schedule_fn(n_rows, batch, 1, lr, warmup_rate=0.05)
    return Trainer(deployer, collate_fn, apply_fn, loss_fn, params, optax.adamw(schedule),
                   lr_schedule_fn=schedule, trainable=lora.trainable_mask(params),
                   params_sharding_rules=rules, remat=remat_policy)


def test_lora_over_an_nf4_base_learns_as_over_the_full_precision_base(base):
    """One epoch of 1024 chains (32 updates of 32 rows, dp 4 x mp 2): the held-out loss over
    the NF4 base within 2% of the loss the same run reaches over the float32 base, written out
    as measured (1.0705 and 1.0714 x the entropy rate): under 1.0714 x 1.02 = 1.093 x the
    entropy rate, under the 16 states' uniform loss (1.41 x)."""
    transitions, stationary, entropy_rate = markov_chain()
    train = sample_chains(transitions, stationary, 1024, 33, seed=1)
    test = sample_chains(transitions, stationary, 256, 33, seed=2)
    trainer = lora_trainer(base, "nf4", len(train), n_model_shards=2)
    trainer.fit(train, 8, 1)
    loss = trainer.eval_loss(test, 8)
    print(loss / entropy_rate)
    assert loss < 1.0714 * 1.02 * entropy_rate < np.log(16), loss / entropy_rate



@pytest.mark.slow
def test_lora_over_an_nf4_base_and_over_the_float32_base_side_by_side(base):
    """The measurement the CI test above writes out, live: the same run over the float32 base
    and over the NF4 base, held-out losses within 2% of each other (CI guard:
    test_lora_over_an_nf4_base_learns_as_over_the_full_precision_base)."""
    transitions, stationary, entropy_rate = markov_chain()
    train = sample_chains(transitions, stationary, 1024, 33, seed=1)
    test = sample_chains(transitions, stationary, 256, 33, seed=2)
    losses = {}
    for fmt in (None, "nf4"):
        trainer = lora_trainer(base, fmt, len(train), n_model_shards=2)
        trainer.fit(train, 8, 1)
        losses[fmt] = trainer.eval_loss(test, 8)
    print({k: v / entropy_rate for k, v in losses.items()})
    assert losses[None] < 1.15 * entropy_rate < np.log(16)
    assert losses["nf4"] == pytest.approx(losses[None], rel=0.02)

def specs(trainer, module):
    """``{param name: its PartitionSpec}`` of the params of ``module`` (a path)."""
    return {path.rpartition("/")[2]: leaf.sharding.spec for path, leaf in
            named_leaves(trainer.params) if path.rpartition("/")[0] == module}


@pytest.fixture(scope="module")
def one_device_run(base):
    """What the split runs are compared with: 64 rows of 17 tokens, and the adapters and eval
    loss of two updates (32 rows each) over the NF4 base on one device."""
    transitions, stationary, _ = markov_chain()
    rows = sample_chains(transitions, stationary, 64, 17, seed=3)
    one = lora_trainer(base, "nf4", len(rows), 32, 3e-2, n_local_devices=1)
    one.train_epoch(rows, 32, 0)
    assert one.step == 2
    return rows, jax.device_get(one.params), one.eval_loss(rows, 32)


def assert_trains_as_one_device(split, one_device_run, batch):
    """``split`` after two updates of ``batch`` rows a replica: one device's params and eval
    loss (1e-5, fp32)."""
    rows, one_params, one_loss = one_device_run
    split.train_epoch(rows, batch, 0)
    assert split.step == 2
    for a, b in zip(jax.tree.leaves(jax.device_get(split.params)), jax.tree.leaves(one_params)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=1e-5, atol=1e-5)
    assert split.eval_loss(rows, batch) == pytest.approx(one_loss, rel=1e-5)


def test_dp_by_mp_trains_as_one_device_with_codes_and_scales_split_together(base,
                                                                           one_device_run):
    """Two updates over an NF4 base: dp 4 x mp 2 gives one device's adapters and eval loss
    (1e-5, fp32); q_proj's codes, absmaxes and their scales split on the output axis, o_proj's
    on the input (row-parallel), as their float kernels would be."""
    split = lora_trainer(base, "nf4", 64, 8, 3e-2, n_model_shards=2)
    assert_trains_as_one_device(split, one_device_run, 8)
    q_proj = specs(split, "model/layers/0/self_attn/q_proj")
    o_proj = specs(split, "model/layers/0/self_attn/o_proj")
    assert {q_proj[k] for k in ("kernel", "kernel_absmax")} == {jax.P(None, "mp")}, q_proj
    assert {o_proj[k] for k in ("kernel", "kernel_absmax")} == {jax.P("mp", None)}, o_proj
    assert q_proj["lora_b"] == jax.P(None, "mp") and o_proj["lora_a"] == jax.P("mp", None)


def per_layer(params) -> dict[str, np.ndarray]:
    """``params`` by per-layer name (a stack cut into its layers), as float32 on the host."""
    return layer_stacks.unstack({p: np.asarray(x, np.float32) for p, x in
                                 named_leaves(jax.device_get(params))})


def test_scanned_layers_under_fsdp_quantise_each_layer_alone_and_train_as_one_device(
        base, one_device_run):
    """The layers stacked and scanned (``scan_layers``) under FSDP (``auto+fsdp``, dp 4 x mp 2):
    each layer's codes, scales and adapters as the unrolled model's (each layer quantised
    alone), two updates giving one device's unrolled adapters and eval loss (1e-5), and
    o_proj's codes and absmaxes split together over mp and dp behind a whole layer axis."""
    rows, one_params, one_loss = one_device_run
    unrolled = lora_trainer(base, "nf4", 64, 8, 3e-2, n_model_shards=2)
    scanned = lora_trainer(base, "nf4", 64, 8, 3e-2, scan=True, n_model_shards=2,
                           sharding_rules="auto+fsdp")
    np.testing.assert_equal(per_layer(scanned.params), per_layer(unrolled.params))
    scanned.train_epoch(rows, 8, 0)
    want = per_layer(one_params)
    for path, value in per_layer(scanned.params).items():
        np.testing.assert_allclose(value, want[path], rtol=1e-5, atol=1e-5, err_msg=path)
    assert scanned.eval_loss(rows, 8) == pytest.approx(one_loss, rel=1e-5)
    q_stack = specs(scanned, "model/layers/0:2/self_attn/q_proj")
    o_stack = specs(scanned, "model/layers/0:2/self_attn/o_proj")
    assert q_stack["kernel"] == jax.P(None, "dp", "mp")  # (its absmaxes: 2 rows, not 4: whole)
    assert {o_stack[k] for k in ("kernel", "kernel_absmax")} == {jax.P(None, "mp", "dp")}
    assert o_stack["kernel_absmax_offset"] == jax.P()  # (one offset a layer, whole)


def test_context_parallel_fsdp_and_full_remat_train_as_one_device(base, one_device_run):
    """Two updates over an NF4 base with dp 2 x cp 2 x mp 2 (each row's 16 tokens split over
    cp, ring attention; FSDP over dp x cp) and every layer rematerialised (``remat="full"``:
    its forward pass, the dequantisation with it, runs again in the backward pass): one
    device's adapters and eval loss without CP or remat (1e-5, fp32; measured ~1.4e-6). The
    codes are shared out over dp x cp, as a float kernel is under FSDP."""
    traced = remat.layers_traced()
    split = lora_trainer(base, "nf4", 64, 16, 3e-2, "full", n_model_shards=2,
                         n_context_shards=2, context_strategy="ring", sharding_rules="auto+fsdp")
    assert split.deployer.mesh.shape == {"dp": 2, "cp": 2, "mp": 2}
    assert_trains_as_one_device(split, one_device_run, 16)
    assert remat.layers_traced() - traced >= MARKOV.num_hidden_layers  # "full" was in force
    q_proj = specs(split, "model/layers/0/self_attn/q_proj")
    assert q_proj["kernel"] == jax.P(("dp", "cp"), "mp"), q_proj


def test_redco_zoo_run_sft_with_quantize_base(tmp_path, capsys):
    """Without ``--lora_rank`` (or ``auto`` without ``--n_model_shards auto``) the run is
    refused, naming the fix; with it, SFT over an NF4 base (its layers stacked and scanned)
    trains and ``workdir/model`` is a plain model (no codes, scales or adapters), its
    projections the base within NF4's error bound (``nf4_bound``, written out above; quantised,
    so not exactly) plus (alpha / r) B A of the saved PEFT adapters."""
    tokenizer = chat_tokenizer()
    model_dir = str(tmp_path / "llama")
    save_model_dir(tiny_llama(len(SPECIALS) + len(WORDS)), tokenizer._tokenizer, model_dir)
    tokenizer.save_pretrained(model_dir)  # (the chat template)
    write_chats(tmp_path / "train.jsonl", 64, seed=0)
    args = ["zoo", "run", "sft", "--model", model_dir, "--train", str(tmp_path / "train.jsonl"),
            "--max_len", "64", "--per_device_batch_size", "2", "--n_model_shards", "2",
            "--learning_rate", "3e-3", "--quantize_base", "nf4"]
    with pytest.raises(SystemExit) as stop:
        main(args + ["--workdir", str(tmp_path / "refused")])
    assert stop.value.code == 2 and "--quantize_base nf4 without --lora_rank: a quantised base " \
        "is frozen and cannot be trained; add --lora_rank" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(args[:-1] + ["auto", "--workdir", str(tmp_path / "auto"), "--lora_rank", "4"])
    assert "--quantize_base auto lets the layout planner choose the base's format with the " \
        "layout: add --n_model_shards auto" in capsys.readouterr().err
    main(args + ["--workdir", str(tmp_path / "w"), "--lora_rank", "4", "--scan_layers"])
    log = (tmp_path / "w" / "log.txt").read_text()
    assert "LoRA rank 4, alpha 16.0: training" in log and "eval loss" in log, log
    tensors = load_file(str(tmp_path / "w" / "model" / "model.safetensors"))
    base = load_file(str(tmp_path / "llama" / "model.safetensors"))
    assert sorted(tensors) == sorted(base)
    name = "model.layers.0.self_attn.q_proj.weight"
    adapter = load_file(str(tmp_path / "w" / "adapter" / "adapter_model.safetensors"))
    a, b = (adapter[f"base_model.model.{name[:-7]}.lora_{x}.weight"] for x in "AB")
    assert np.abs(b).max() > 1e-4  # (the adapters trained)
    w = base[name].T  # [in, out], as quantised (blocks of 64 inputs)
    error = np.abs((tensors[name] - 16.0 / 4 * b @ a).T - w)
    assert np.all(error <= nf4_bound(w) * (1 + 1e-5) + 1e-6) and error.max() > 0, error.max()


def test_a_kernel_nf4_cannot_block_is_refused_naming_the_formats_that_can():
    with pytest.raises(ValueError, match=r"divide by 64.*\(96, 32\).*int8 or fp8"):
        q.quantize(np.zeros((96, 32), np.float32), "nf4")
    with pytest.raises(ValueError, match=r"'nf5'.*\['nf4', 'int8', 'fp8'\]"):
        q.quantize(np.zeros((64, 32), np.float32), "nf5")


def test_redco_zoo_run_sft_quantize_base_auto_trains_on_what_the_planner_chose(tmp_path, capsys):
    """``--n_model_shards auto --quantize_base auto``: planned once before the model is loaded,
    and the run uses the pick. A 2-layer LLaMA of width 256 (projections 1.5M weights), 8
    devices, one row of 32 tokens: LoRA over the fp32 base peaks at 1.82 MiB at best (mp=8),
    over an int8 base at 1.38 MiB at mp=4 (measured); 1.8 MB (1.62 MiB usable) fits only the
    int8 base, so the plan is int8 at mp=4 and the saved model is the int8 base dequantised
    (the formula written out here) plus the adapters."""
    tokenizer = chat_tokenizer()
    model_dir = str(tmp_path / "llama")
    config = LlamaConfig(vocab_size=len(SPECIALS) + len(WORDS), hidden_size=256,
                         intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2)
    save_model_dir(LlamaForCausalLM(config, rngs=nnx.Rngs(0)), tokenizer._tokenizer, model_dir)
    tokenizer.save_pretrained(model_dir)
    write_chats(tmp_path / "train.jsonl", 16, seed=0)
    main(["zoo", "run", "sft", "--model", model_dir, "--train", str(tmp_path / "train.jsonl"),
          "--max_len", "32", "--per_device_batch_size", "1", "--max_steps", "2",
          "--learning_rate", "3e-3", "--lora_rank", "4", "--n_model_shards", "auto",
          "--device_memory", "1.8MB", "--quantize_base", "auto",
          "--workdir", str(tmp_path / "w")])
    out = capsys.readouterr().out
    assert "planned before loading: LoRA rank 4 over an INT8 base, n_model_shards=4, " \
        "sharding_rules='auto'" in out, out
    assert "why: no layout fits LoRA rank 4 over the unquantised base; with LoRA rank 4 over " \
        "an INT8 base" in out
    assert re.search(r"mp=8 .* lora r=4 peak .*  does not fit", out)  # (plain LoRA's best)
    log = (tmp_path / "w" / "log.txt").read_text()
    assert "'mp': 4" in log or "mp=4" in log, log
    name = "model.layers.0.mlp.down_proj.weight"
    base = load_file(str(tmp_path / "llama" / "model.safetensors"))[name]
    tensors = load_file(str(tmp_path / "w" / "model" / "model.safetensors"))
    adapter = load_file(str(tmp_path / "w" / "adapter" / "adapter_model.safetensors"))
    a, b = (adapter[f"base_model.model.{name[:-7]}.lora_{x}.weight"] for x in "AB")
    scale = np.abs(base).max(1, keepdims=True) / 127  # int8, per output channel (torch: rows)
    np.testing.assert_allclose(tensors[name], np.round(base / scale) * scale + 16.0 / 4 * b @ a,
                               rtol=1e-5, atol=1e-6)


def test_the_plan_measures_lora_on_the_runs_targets():
    """``--lora_targets`` reaches what the planner measures (``base_plan.lora_models``): over
    the fp32 and the NF4 base, q_proj and v_proj alone hold 2 layers x r x ((128 + 128) +
    (128 + 64)) adapter values (width 128, 2 of 4 heads' keys and values), the seven
    projections 2 x r x (4 x 128 + 2 x 192 + 3 x 384): the shapes written out."""
    from redco_planner.models import zoo_llama
    from redco_zoo_models.base_plan import lora_models
    from redco_zoo_models.settings import LoRA
    model = zoo_llama(seq_len=16, vocab_size=16, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)

    def adapter_bytes(lora_model) -> int:
        return sum(leaf.size * leaf.dtype.itemsize for path, leaf in
                   named_leaves(lora_model.params) if lora.is_adapter_path(path))
    for targets, values in (("(q_proj|v_proj)/kernel$", 2 * 4 * (256 + 192)),
                            (lora.DEFAULT_TARGETS, 2 * 4 * (4 * 128 + 2 * 192 + 3 * 384))):
        plain, quantized = lora_models(model, LoRA(rank=4, targets=targets))
        assert adapter_bytes(plain) == adapter_bytes(quantized(4, "nf4")) == 4 * values
