"""Gemma 4 beyond the shared suite (test_parity_families' ``gemma4``: per-layer inputs, KV
sharing, proportional RoPE, full layers of their own head size, the MoE block beside every
MLP): full layers whose values are their keys' projection (``attention_k_eq_v``) with their
own key/value heads, the 26B-A4B's layout (the MoE block, no per-layer inputs or sharing) with
its layers stacked, against transformers' ``Gemma4ForCausalLM``; and what is refused before
compiling."""
import numpy as np
import pytest
import torch
from flax import nnx
from parity import close, jiggle_torch, load_hf, transformers
from test_parity_families import ATOL, FAMILIES, jitted, random_buffers, torch_logits

from redco.tree_paths import named_leaves
from redco_zoo_models import from_pretrained, save_pretrained
from redco_zoo_models.decoder_config import DecoderConfig
from redco_zoo_models.hf import auto_class
from redco_zoo_models.toy import TINY_FAMILIES

K_EQ_V = dict(TINY_FAMILIES["gemma4"], attention_k_eq_v=True, num_global_key_value_heads=1)
PLAIN = dict(FAMILIES["gemma4"], hidden_size_per_layer_input=0, num_kv_shared_layers=0,
             use_double_wide_mlp=False, layer_types=[
                 "sliding_attention", "sliding_attention", "full_attention",
                 "sliding_attention", "full_attention"])  # (no per-layer inputs, no sharing;
#                                                           the MoE block beside each MLP)


def saved(config: dict, path, seed: int):
    """transformers' model of ``config`` (weights and layer scalars perturbed), saved in
    ``path``."""
    config = dict(config)
    config = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
    torch.manual_seed(seed)
    theirs = random_buffers(jiggle_torch(transformers.AutoModelForCausalLM.from_config(config)))
    theirs.save_pretrained(str(path))
    return theirs


def test_keys_as_values_logits_equal_transformers(tmp_path):
    """40 tokens (past the window of 8), full layers with one key/value head whose values are
    the keys' projection (no ``v_proj``): transformers' logits."""
    theirs = saved(K_EQ_V, tmp_path, seed=1)
    assert theirs.model.layers[1].self_attn.v_proj is None  # (keys as values there)
    ours = from_pretrained(auto_class(str(tmp_path)), str(tmp_path))
    ids = np.random.RandomState(40).randint(1, 63, (2, 40))
    close(jitted(ours)(ids), torch_logits(theirs, ids), ATOL["gemma4"])


def test_scanned_layers_without_sharing_read_and_write_transformers_checkpoints(tmp_path):
    """Without per-layer inputs or KV sharing (the 26B-A4B's layout: the 31B's with the MoE
    block), the layers stacked in runs of like layers (sliding ones of one head size, full
    ones of another; each one's MLP, router, experts and their norms stacked) give
    transformers' logits, and written back, transformers reads them whole."""
    theirs = saved(PLAIN, tmp_path / "in", seed=3)
    ours = from_pretrained(auto_class(str(tmp_path / "in")), str(tmp_path / "in"),
                           scan_layers=True)
    assert any(":" in p and "/moe/experts/" in p
               for p, _ in named_leaves(nnx.state(ours, nnx.Param)))
    ids = np.random.RandomState(42).randint(1, 63, (2, 40))
    want = torch_logits(theirs, ids)
    close(jitted(ours)(ids), want, ATOL["gemma4"])
    save_pretrained(ours, str(tmp_path / "out"))
    back = load_hf(type(theirs), str(tmp_path / "out"))
    close(torch_logits(back, ids), want, ATOL["gemma4"])


@pytest.mark.parametrize("change, named", [
    (dict(enable_moe_block=True, num_experts=4, moe_intermediate_size=8), "top_k_experts"),
    (dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
    (dict(num_kv_shared_layers=5), "num_kv_shared_layers"),
])
def test_what_gemma4_does_not_run_is_refused_naming_it(change, named):
    with pytest.raises(ValueError, match=named):
        DecoderConfig.from_hf(dict(TINY_FAMILIES["gemma4"], **change))


def test_stacked_layers_with_kv_sharing_are_refused_before_building():
    cfg = DecoderConfig.from_hf(TINY_FAMILIES["gemma4"])
    with pytest.raises(ValueError, match="scan_layers"):
        DecoderConfig(**{**cfg.__dict__, "scan_layers": True})


def test_the_multimodal_checkpoints_text_part_gives_transformers_logits(tmp_path):
    """A ``gemma4`` checkpoint (``Gemma4ForConditionalGeneration``: a tiny vision tower beside
    the language model, ``model.language_model.*``, its layers' routers and experts too) read
    as its language model: the logits of transformers' whole model on text alone."""
    text = {k: v for k, v in FAMILIES["gemma4"].items() if k != "model_type"}
    config = transformers.Gemma4Config(text_config=text, audio_config=None, vision_config=dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=8, patch_size=4, position_embedding_size=64))
    torch.manual_seed(2)
    theirs = random_buffers(jiggle_torch(transformers.Gemma4ForConditionalGeneration(config)))
    theirs.save_pretrained(str(tmp_path))
    ours = from_pretrained(auto_class(str(tmp_path)), str(tmp_path))
    ids = np.random.RandomState(41).randint(1, 63, (2, 40))
    with torch.no_grad():
        want = theirs(input_ids=torch.tensor(ids)).logits.numpy()
    close(jitted(ours)(ids), want, ATOL["gemma4"])
