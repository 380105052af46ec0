"""LoRA exports against transformers 5 and peft (PyTorch): a LoRA model saved merged
(``save_pretrained``) loads in transformers with the LoRA JAX model's logits, and its unmerged
adapters (``save_peft_adapters``) load with ``peft.PeftModel.from_pretrained`` onto the base
model with the same logits, for LLaMA (1e-4; its layers unrolled and scanned, stacked with
their adapters) and T5 (v1.0 and flan; ``parity.close``, 5e-4:
the adapters here move T5's logits by about 5, and on CI's CPUs torch's own merged and PEFT
models of flan then differ from each other by up to 3.9e-4)."""
import jax
import jax.numpy as jnp
import numpy as np
import peft  # installed by tox -e zoo-parity: missing is an error, not a skip
import pytest
from flax import nnx
from parity import close as close_fp32
from parity import jiggle_ours, load_hf, torch, torch_logits, transformers
from test_parity_t5 import batch
from test_parity_t5 import jax_logits as t5_jax_logits
from test_parity_t5 import jax_model as t5_jax_model
from test_parity_t5 import torch_logits as t5_torch_logits

from redco_zoo_models import LlamaConfig, LlamaForCausalLM, add_lora, save_pretrained
from redco_zoo_models.lora import save_peft_adapters

IDS = np.random.RandomState(0).randint(1, 64, (3, 9))
LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)


def trained_adapters(model, seed=1):
    """Adapters as if trained: A and B random (B starts at zero, which would hide a mistake)."""
    params = nnx.state(model, nnx.Param)
    leaves, tree = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    nnx.update(model, jax.tree.unflatten(tree, [
        0.3 * jax.random.normal(k, x.shape) if "lora_" in jax.tree_util.keystr(p) else x
        for (p, x), k in zip(leaves, keys)]))
    return model


def exports(model, tmp_path, rank=4, alpha=8.0):
    """Save the base, then add and 'train' adapters: (the LoRA model, base dir, merged dir,
    adapter dir)."""
    save_pretrained(model, str(tmp_path / "base"))
    trained_adapters(add_lora(model, rank=rank, alpha=alpha))
    save_pretrained(model, str(tmp_path / "merged"))
    save_peft_adapters(model, str(tmp_path / "adapter"), str(tmp_path / "base"))
    return model, tmp_path / "base", tmp_path / "merged", tmp_path / "adapter"


def close(ours, theirs):
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), atol=1e-4, rtol=1e-4)


def with_peft(base, adapter_dir):
    model = peft.PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    n_adapted = sum(isinstance(m, peft.tuners.lora.LoraLayer) for m in model.modules())
    return model, n_adapted


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_llama_lora_merged_and_peft_exports_give_the_lora_models_logits(scan, tmp_path):
    """Scanned: layers and adapters stacked (``layer_scan``), exported per layer."""
    ours, base, merged, adapter = exports(jiggle_ours(LlamaForCausalLM(
        LlamaConfig(**LLAMA, scan_layers=scan), nnx.Rngs(0))), tmp_path)
    want = np.asarray(ours(jnp.asarray(IDS)))
    base_logits = torch_logits(load_hf(transformers.LlamaForCausalLM, str(base)), input_ids=IDS)
    assert np.abs(want - base_logits).max() > 1e-2  # the adapters change the model
    merged_logits = torch_logits(load_hf(transformers.LlamaForCausalLM, str(merged)), input_ids=IDS)
    close(want, merged_logits)
    model, n_adapted = with_peft(load_hf(transformers.LlamaForCausalLM, str(base)), adapter)
    assert n_adapted == 2 * 7
    peft_logits = torch_logits(model, input_ids=IDS)
    close(want, peft_logits)
    print(f"LLaMA LoRA: merged max diff {np.abs(want - merged_logits).max():.2e}, "
          f"peft max diff {np.abs(want - peft_logits).max():.2e}")


@pytest.mark.parametrize("kind", ["t5", "flan"])
def test_t5_lora_merged_and_peft_exports_give_the_lora_models_logits(kind, tmp_path):
    ours, base, merged, adapter = exports(t5_jax_model(kind), tmp_path, rank=2, alpha=4.0)
    load = transformers.T5ForConditionalGeneration.from_pretrained
    for inputs in (batch(0), batch(1)):
        want = t5_jax_logits(ours, *inputs)
        base_logits = t5_torch_logits(load(str(base)).eval(), *inputs)
        assert np.abs(want - base_logits).max() > 1  # the adapters change the model
        close_fp32(want, t5_torch_logits(load(str(merged)).eval(), *inputs))
        model, n_adapted = with_peft(load(str(base)).eval(), adapter)
        ffn = 2 if kind == "t5" else 3
        assert n_adapted == 2 * (4 + ffn) + 3 * (8 + ffn)  # 2 encoder, 3 decoder layers
        close_fp32(want, t5_torch_logits(model, *inputs))
    assert torch.get_default_dtype() == torch.float32
