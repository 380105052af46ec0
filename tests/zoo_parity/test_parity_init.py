"""A from-scratch zoo decoder starts as transformers' PyTorch model of the family starts
(``redco_zoo_models.hf_init``), for every tiny family of ``redco_zoo_models.toy`` (Gemma 4's
with its MoE block, as test_parity_families reads it).

Both sides are built from the same config.json (``initializer_range`` 0.05, not transformers'
default 0.02, so it must be read) with no weights loaded; each side's tensors under the
checkpoint's names are pooled per kind (layer and expert indices dropped: every q_proj of every
layer is one kind). A kind transformers sets to a constant (norm scales, biases) must be that
constant in the zoo too; a kind it draws must be drawn (not constant) and have the same mean
and std as transformers' within five standard errors of the difference of two samples of
``N(0, s)``, sizes ``n`` and ``m``: the sample mean's standard error is
``s * sqrt(1/n + 1/m)``, the sample std's ``s * sqrt(1/(2n) + 1/(2m))``. Flax's defaults
(LeCun-normal kernels: std ``1/sqrt(fan_in)``, 0.18 at width 32; unit-variance embeddings)
are many of those errors away.

The first loss of a LLaMA on random tokens is ``ln V`` plus half the variance of its logits
(a second-order expansion of ``log-sum-exp`` about equal logits): the final norm leaves
hidden states of unit mean square, so a head drawn at std ``s`` gives logits of variance
``s^2 * hidden``, ``0.02^2 * 32``: 0.0064 above ``ln V``. Flax's LeCun-normal head gives
logits of variance 1, ``ln V + 1/2``.
"""
import math
import re

import numpy as np
import pytest
import torch
from flax import nnx
from parity import transformers
from test_parity_families import FAMILIES

from redco_zoo_models import LlamaConfig, LlamaForCausalLM, save_pretrained
from redco_zoo_models.hf import read_safetensors
from redco_zoo_models.toy import TINY_FAMILIES

STD, SIGMAS = 0.05, 5.0
CONFIGS = {**TINY_FAMILIES, "gemma4": FAMILIES["gemma4"]}  # (Gemma 4 with its MoE block)
DRAWN_PAD = ("nemotron-h",)  # (its padding row drawn as the rest: pooled with them below)


def kinds(tensors: dict) -> dict[str, np.ndarray]:
    """Tensors pooled by name with layer and expert indices dropped, float64."""
    pooled: dict[str, list] = {}
    for name, t in tensors.items():
        pooled.setdefault(re.sub(r"\.\d+\.", ".*.", name), []).append(
            np.asarray(t, np.float64).ravel())
    return {k: np.concatenate(v) for k, v in pooled.items()}


def theirs_from_scratch(config: dict, path) -> dict[str, np.ndarray]:
    """transformers' model's tensors as its ``save_pretrained`` writes them."""
    config = dict(config)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(
        config.pop("model_type"), **config)).save_pretrained(str(path))
    return read_safetensors(str(path))


def ours_from_scratch(config: dict, path) -> dict[str, np.ndarray]:
    """The zoo model's tensors as its ``save_pretrained`` writes them."""
    save_pretrained(LlamaForCausalLM(LlamaConfig.from_hf(config), nnx.Rngs(0)), str(path))
    return read_safetensors(str(path))


@pytest.mark.parametrize("family", CONFIGS)
def test_from_scratch_params_have_transformers_init_statistics(family, tmp_path):
    config = dict(CONFIGS[family], initializer_range=STD)
    ours_tensors = ours_from_scratch(config, tmp_path / "ours")
    theirs_tensors = theirs_from_scratch(config, tmp_path / "theirs")
    assert set(ours_tensors) == set(theirs_tensors), set(ours_tensors) ^ set(theirs_tensors)
    pad = config["pad_token_id"]
    for side in (ours_tensors, theirs_tensors) if family not in DRAWN_PAD else ():
        assert not np.any(side["model.embed_tokens.weight"][pad])  # the padding row starts at 0
    ours, theirs = kinds(ours_tensors), kinds(theirs_tensors)
    for kind, b in theirs.items():
        a, n, m = ours[kind], ours[kind].size, b.size
        if b.std() == 0:
            assert np.all(a == b[0]), f"{family} {kind}: transformers sets {b[0]}, ours {a[:4]}"
            continue
        assert a.std() > 0, f"{family} {kind}: transformers draws it, ours sets {a[0]}"
        spread = b.std()  # (STD for the normal draws; a log-uniform A_log's own)
        mean_tol = SIGMAS * spread * math.sqrt(1 / n + 1 / m)
        std_tol = SIGMAS * spread * math.sqrt(1 / (2 * n) + 1 / (2 * m))
        assert abs(a.mean() - b.mean()) < mean_tol, (family, kind, a.mean(), b.mean(), mean_tol)
        assert abs(a.std() - b.std()) < std_tol, (family, kind, a.std(), b.std(), std_tol)


def test_first_loss_on_random_tokens_is_log_vocab():
    """Against the expansion in the module docstring, and transformers' first loss on the
    same tokens; the tolerance, 0.05, is a tenth of Flax's default's excess (1/2)."""
    config = TINY_FAMILIES["llama-3.1"]
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    ids = np.random.RandomState(0).randint(0, vocab, (4, 32))
    model = LlamaForCausalLM(LlamaConfig.from_hf(config), nnx.Rngs(0))
    ours = float(model(ids[:, :-1], labels=ids[:, 1:]))
    expected = math.log(vocab) + 0.02 ** 2 * hidden / 2
    torch.manual_seed(0)
    spec = {k: v for k, v in config.items() if k != "model_type"}
    theirs_model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model("llama", **spec))
    with torch.no_grad():
        theirs = float(theirs_model(torch.tensor(ids), labels=torch.tensor(ids)).loss)
    assert abs(ours - expected) < 0.05, (ours, expected)
    assert abs(ours - theirs) < 0.05, (ours, theirs)
