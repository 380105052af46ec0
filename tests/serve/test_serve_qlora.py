"""Serving a QLoRA model: a quantised base with LoRA adapters, unmerged. The engine (dp 4 x mp 2,
the codes and their scales split together) over an NF4, an int8 and an fp8 (e4m3) base, and
``redco serve --quantize_base nf4 --adapter DIR``, asked by the real ``openai`` client, give
transformers' greedy tokens and log-probs (CPU torch) over the model the test writes out itself:
the codes dequantised in numpy (NF4: the code book's published values, the double-quantised
absmaxes; int8 and fp8: the code times its output channel's scale) plus ``(alpha / r) B A`` of
the PEFT file."""
import functools

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from redco_serve.command import load_served
from safetensors.numpy import load_file
from test_serve import WORDS, Server
from transformers import AutoModelForCausalLM, AutoTokenizer

from redco import Deployer
from redco.layer_stacks import unstack
from redco.tree_paths import named_leaves
from redco_zoo_models.engine import Engine
from redco_zoo_models.lora import add_lora, load_peft_adapters, lora_layers, save_peft_adapters
from redco_zoo_models.quantized_linear import sharding_rules
from redco_zoo_models.requests import Sampling
from redco_zoo_models.runner import load_model
from redco_zoo_models.toy import save_tiny_chat_model

PROMPTS, NEW, RANK, ALPHA = ["the cat sat on a mat and then", "it ran off"], 6, 4, 8.0
NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
       -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
       0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
       0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]  # (QLoRA's paper)


@pytest.fixture(scope="module")
def qlora(tmp_path_factory):
    """A tiny chat model's directory (the base) and a PEFT directory of rank-4 adapters over
    its NF4 projections, B drawn (not zeros) so that the adapters change every answer."""
    root = tmp_path_factory.mktemp("qlora")
    base = save_tiny_chat_model(str(root / "base"), WORDS)
    model, _ = load_model(base, quantize="nf4")
    add_lora(model, RANK, ALPHA)
    rng = np.random.default_rng(0)
    for _, layer in lora_layers(model):
        layer.lora_b.set_value(jax.numpy.asarray(rng.normal(0, 0.3, layer.lora_b.shape),
                                                 np.float32))
    return base, save_peft_adapters(model, str(root / "adapter"))


def dequantized_nf4(parts: dict) -> np.ndarray:
    """``W`` [in, out] from NF4 parts, in numpy: row 2i in a byte's low nibble, 2i + 1 in its
    high one, blocks of 64 rows times their absmax (int8 x its scale per 256 columns + the
    offset)."""
    codes = parts["kernel"]
    indices = np.stack([codes & 15, codes >> 4], axis=1).reshape(2 * len(codes), -1)
    scale = np.repeat(parts["kernel_absmax_scale"], codes.shape[1] // parts[
        "kernel_absmax_scale"].shape[1], axis=1)
    absmax = parts["kernel_absmax"].astype(np.float32) * scale + parts["kernel_absmax_offset"]
    return np.asarray(NF4, np.float32)[indices] * np.repeat(absmax, 64, axis=0)


def dequantized(parts: dict) -> np.ndarray:
    """``W`` [in, out] from any format's parts: NF4's, or int8 or fp8 (e4m3) codes times their
    output channel's float32 scale."""
    if "kernel_absmax" in parts:
        return dequantized_nf4(parts)
    assert parts["kernel"].dtype in (np.int8, ml_dtypes.float8_e4m3fn), parts["kernel"].dtype
    return parts["kernel"].astype(np.float32) * parts["kernel_scale"]


def transformers_answers(qlora, fmt: str):
    """transformers' greedy tokens and their log-probs for each prompt, over the merged model
    of the ``fmt`` base written out here (module docstring)."""
    base, adapter = qlora
    quantized, _ = load_model(base, quantize=fmt)
    parts = {}  # (a stacked model's parts cut per layer)
    for path, leaf in unstack(dict(named_leaves(nnx.state(quantized, nnx.Param)))).items():
        module, _, name = path.rpartition("/")
        parts.setdefault(module.replace("/", "."), {})[name] = np.asarray(leaf)
    peft = load_file(f"{adapter}/adapter_model.safetensors")
    theirs = AutoModelForCausalLM.from_pretrained(base).eval()
    merged = 0
    with torch.no_grad():
        for name, param in theirs.named_parameters():
            module = name.removesuffix(".weight")
            if not any(k.startswith("kernel_") for k in parts.get(module, {})):
                continue
            a, b = (peft[f"base_model.model.{module}.lora_{x}.weight"] for x in "AB")
            param.copy_(torch.tensor(dequantized(parts[module]).T + ALPHA / RANK * b @ a))
            merged += 1
    assert merged == 2 * 7  # every attention and MLP projection of both layers
    tokenizer = AutoTokenizer.from_pretrained(base, local_files_only=True)
    answers = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            out = theirs.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False,
                                  eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id)[0, len(ids):].tolist()
            tokens = out[:out.index(tokenizer.eos_token_id) + 1] \
                if tokenizer.eos_token_id in out else out
            logits = theirs(torch.tensor([ids + tokens])).logits[0].double()
        places = np.arange(len(tokens)) + len(ids) - 1
        answers.append((ids, tokens, torch.log_softmax(logits, -1).numpy()[places, tokens]))
    return tokenizer, answers


@pytest.fixture(scope="module")
def reference(qlora):
    """``reference(fmt)``: ``transformers_answers`` over the ``fmt`` base, made once a format."""
    return functools.cache(functools.partial(transformers_answers, qlora))


CODES = {"nf4": np.uint8, "int8": np.int8, "fp8": ml_dtypes.float8_e4m3fn}


@pytest.mark.parametrize("fmt", list(CODES))
def test_the_engine_over_a_quantised_base_with_adapters_answers_as_the_dequantised_merged_model(
        qlora, reference, fmt):
    """dp 4 x mp 2: the codes stay in their 8 (or 4) bits on the devices, split with their
    scales (q_proj on its output axis: NF4's absmaxes as the codes, a per-channel scale along
    it); the engine's greedy tokens are transformers' and their log-probs within 1e-5 for every
    format: both sides multiply by the same float32 weights (the dequantisation is exact in
    float32 either side), so what differs is float32 summation order over a 2-layer model
    (~1e-6), not the format's quantisation error, which the reference shares."""
    tokenizer, answers = reference(fmt)
    model, _ = load_served(qlora[0], fmt, qlora[1], scan_layers=True)  # (the adapters stacked)
    params = nnx.state(model, nnx.Param)
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=None, verbose=False)
    rules = deployer.get_sharding_rules(params, rules=sharding_rules(model, deployer))
    params = jax.device_put(params, deployer.get_params_shardings(params, rules))
    q_proj = params["model"]["layers"]["0:2"]["self_attn"]["q_proj"]
    assert q_proj["kernel"][...].dtype == CODES[fmt]
    scale = "kernel_absmax" if fmt == "nf4" else "kernel_scale"
    assert {q_proj[k][...].sharding.spec for k in ("kernel", "lora_b")} == \
        {jax.P(None, None, "mp")}  # (the layer axis whole)
    assert q_proj[scale][...].sharding.spec == (jax.P(None, None, "mp") if fmt == "nf4" else
                                               jax.P(None, "mp"))
    engine = Engine(model, params, max_seqs=4, max_len=32, mesh=deployer.mesh,
                    eos_token_ids=(tokenizer.eos_token_id,))
    requests = engine.generate([ids for ids, _, _ in answers], Sampling(max_tokens=NEW))
    for (_, tokens, logprobs), request in zip(answers, requests):
        assert request.samples[0].tokens == tokens
        np.testing.assert_allclose(request.samples[0].logprobs, logprobs, atol=1e-5)


def test_redco_serve_quantize_base_with_an_adapter_answers_as_the_merged_model(qlora, reference):
    """The ``openai`` client's greedy completion (the server split over 2 of 8 devices): the
    text of transformers' tokens, their log-probs within 1e-5."""
    tokenizer, answers = reference("nf4")
    server = Server(qlora[0], "--quantize_base", "nf4", "--adapter", qlora[1], "--max_seqs", "2",
                    "--max_len", "16")
    try:
        replies = [server.client.completions.create(model="base", prompt=prompt,
                                                    max_tokens=NEW, temperature=0, logprobs=0)
                   for prompt in PROMPTS]
    finally:
        server.close()
    for (_, tokens, logprobs), reply in zip(answers, replies):
        assert reply.choices[0].text == tokenizer.decode(tokens, skip_special_tokens=True)
        np.testing.assert_allclose(reply.choices[0].logprobs.token_logprobs, logprobs[:len(
            reply.choices[0].logprobs.token_logprobs)], atol=1e-5)


def test_adapters_that_do_not_fit_the_base_are_refused_naming_why(qlora, tmp_path):
    """No PEFT files; adapters for a layer the base lacks; a rank the tensors do not have."""
    import json
    import shutil

    from safetensors.numpy import save_file
    model, _ = load_model(qlora[0], quantize="nf4")
    with pytest.raises(ValueError, match="not a PEFT adapter directory.*workdir/adapter"):
        load_peft_adapters(model, str(tmp_path))
    tensors = load_file(f"{qlora[1]}/adapter_model.safetensors")
    for name, (edit, error) in {
            "layer": ("tensors", r"adapters for \['model.layers.9.self_attn.q_proj'\], which "
                                 "the model has no projection of"),
            "rank": ("config", r"down_proj.lora_A.weight is \(4, 128\), not \(2, 128\) as "
                               "rank 2 over the model's projection")}.items():
        shutil.copytree(qlora[1], tmp_path / name)
        if edit == "tensors":
            save_file({k.replace("layers.1.self_attn.q", "layers.9.self_attn.q"): v
                       for k, v in tensors.items()}, str(tmp_path / name /
                                                         "adapter_model.safetensors"))
        else:
            config = json.loads((tmp_path / name / "adapter_config.json").read_text())
            (tmp_path / name / "adapter_config.json").write_text(json.dumps(dict(config, r=2)))
        with pytest.raises(ValueError, match=error):
            load_peft_adapters(load_model(qlora[0], quantize="nf4")[0], str(tmp_path / name))


def test_redco_serve_loads_the_layers_unrolled_unless_asked(qlora):
    """``redco serve`` decodes through per-layer caches, which a scanned step would copy into and
    out of their stacks each step (``runner.decoding``): unrolled by default, stacked on
    ``--scan_layers``."""
    assert load_served(qlora[0], None, None)[0].cfg.scan_layers is False
    assert load_served(qlora[0], None, None, scan_layers=True)[0].cfg.scan_layers is True
