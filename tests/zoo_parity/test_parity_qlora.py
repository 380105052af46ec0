"""QLoRA against transformers 5 (PyTorch): a checkpoint loaded with its projections quantised
(NF4, int8, fp8) gives logits near the transformers model of the same unquantised checkpoint,
within the bound derived below; and a LoRA model over an NF4 base, saved merged (adapters added
to the dequantised kernels), loads in transformers with our logits.

The bound. Each quantised matmul ``x @ W_q`` differs from ``x @ W`` by ``x @ (W_q - W)``: an
error of relative RMS ``r`` (the weights' own, ``rms(W_q - W) / rms(W)``) for a quantisation
error uncorrelated with ``x`` and ``W``. At transformers' init (std 0.02) the layers are close
to the identity through the residual stream and each normalised, so the 14 projections' errors
(7 per layer, 2 layers) add up independently, in quadrature: the logits' relative RMS error is
at most ``sqrt(14) r`` (measured here: 1.5-2.3 r over seeds and formats). A wrong code book,
block or scale moves the logits by far more than that (r near 1)."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from parity import close, load_hf, torch_logits, transformers
from test_parity_lora import trained_adapters

from redco.tree_paths import named_leaves
from redco_zoo_models import LlamaConfig, LlamaForCausalLM, add_lora, from_pretrained, save_pretrained
from redco_zoo_models import quantize as q
from redco_zoo_models.quantized_linear import quantized_layers

IDS = np.random.RandomState(0).randint(1, 64, (3, 9))
LLAMA = dict(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, initializer_range=0.02)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A random LLaMA saved as a HuggingFace directory, and transformers' logits of it."""
    path = str(tmp_path_factory.mktemp("qlora") / "base")
    save_pretrained(LlamaForCausalLM(LlamaConfig(**LLAMA), nnx.Rngs(0)), path)
    return path, torch_logits(load_hf(transformers.LlamaForCausalLM, path), input_ids=IDS)


def rms(x):
    return float(np.sqrt(np.mean(np.square(x))))


@pytest.mark.parametrize("fmt", q.FORMATS)
def test_quantised_logits_are_within_sqrt_14_times_the_weights_error(base, fmt):
    path, want = base
    # unrolled: each layer's projection its own module (scanned QLoRA: tests/zoo/test_qlora.py)
    ours = from_pretrained(LlamaForCausalLM, path, quantize=fmt, scan_layers=False)
    layers = quantized_layers(ours)
    assert len(layers) == 14
    plain = from_pretrained(LlamaForCausalLM, path, scan_layers=False)
    err = total = 0.0
    kernels = dict(named_leaves(nnx.state(plain, nnx.Param)))
    for module, layer in layers:
        kernel = np.asarray(kernels[f"{module}/kernel"])
        err += np.sum(np.square(np.asarray(q.dequantize(layer.parts(), fmt)) - kernel))
        total += np.sum(np.square(kernel))
    r = float(np.sqrt(err / total))
    logits = np.asarray(ours(jnp.asarray(IDS)))
    relative = rms(logits - want) / rms(want - want.mean(-1, keepdims=True))
    print(f"{fmt}: weights' relative error {r:.4f}, logits' {relative:.4f} ({relative / r:.2f} r)")
    assert 0 < r < {"nf4": 0.1, "int8": 0.01, "fp8": 0.03}[fmt]  # (4, 8, 3+1 bits)
    assert relative <= np.sqrt(14) * r


def test_a_lora_model_over_an_nf4_base_saved_merged_loads_in_transformers_with_our_logits(
        base, tmp_path):
    path, unquantised = base
    ours = trained_adapters(add_lora(from_pretrained(LlamaForCausalLM, path, quantize="nf4"),
                                     rank=4, alpha=8.0))
    save_pretrained(ours, str(tmp_path / "merged"))
    want = np.asarray(ours(jnp.asarray(IDS)))
    assert np.abs(want - unquantised).max() > 1e-2  # the adapters change the model
    close(want, torch_logits(load_hf(transformers.LlamaForCausalLM, str(tmp_path / "merged")),
                             input_ids=IDS))
