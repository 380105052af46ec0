"""The Mamba2 mixer (``redco_zoo_models.mamba2``) against transformers' Granite 4 hybrid Mamba2
layer (its PyTorch reference path; the CUDA kernels are not installed): both of the zoo's scans,
the chunked one at chunk sizes that split the sequence unevenly, into single tokens and not at
all, and the plain recurrence, over a left-padded batch longer than the convolution; a prompt
read into the decoding state and then token by token gives the same outputs; Nemotron-H's
variant of the layer (its shape keys, the floor on dt) read as the zoo reads it. The whole hybrid
models (greedy generation included): tests/zoo_parity/test_parity_families.py
(``granite-4-h*``); the serving engine: test_parity_recurrent_engine.py."""
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from parity import jiggle_torch, transformers

from redco_zoo_models.mamba2 import Mamba2, init_cache, read_config, recurrent_scan
from redco_zoo_models.toy import TINY_FAMILIES

CONFIG = dict(TINY_FAMILIES["granite-4-h-dense"])  # 4 heads of 16 in 2 groups, state 8, conv 4


def layer_pair(chunk: int):
    """transformers' Mamba2 layer (perturbed weights, biased projections) and ours with its
    weights, chunks of ``chunk`` tokens."""
    config = dict(CONFIG, mamba_chunk_size=chunk)
    hf_config = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
    from transformers.models.granitemoehybrid import modeling_granitemoehybrid as hf
    torch.manual_seed(0)
    theirs = jiggle_torch(hf.GraniteMoeHybridMambaLayer(hf_config, 0))
    return theirs, with_weights(Mamba2(read_config(dict(CONFIG, mamba_chunk_size=chunk)),
                                       nnx.Rngs(0)), theirs)


def with_weights(ours, theirs):
    """``ours`` (a zoo ``Mamba2``) holding the weights of ``theirs`` (transformers' layer)."""
    weights = {k: v.detach().numpy() for k, v in theirs.state_dict().items()}
    for linear in ("in_proj", "out_proj"):
        getattr(ours, linear).kernel.value = jnp.asarray(weights[f"{linear}.weight"].T)
        getattr(ours, linear).bias.value = jnp.asarray(weights[f"{linear}.bias"])
    ours.conv1d.weight.value = jnp.asarray(weights["conv1d.weight"][:, 0])
    ours.conv1d.bias.value = jnp.asarray(weights["conv1d.bias"])
    for name in ("dt_bias", "A_log", "D"):
        getattr(ours, name).value = jnp.asarray(weights[name])
    ours.norm.weight.value = jnp.asarray(weights["norm.weight"])
    return ours


@pytest.mark.parametrize("chunk", [8, 1, 64])
def test_the_mamba2_layer_equals_transformers_chunked_and_recurrent(chunk):
    """21 tokens (chunks of 8: two whole and a part; of 1; one chunk past the end), rows behind
    0-3 pads: both scans give transformers' outputs at the real tokens within 1e-4."""
    theirs, ours = layer_pair(chunk)
    x = np.random.RandomState(0).randn(4, 21, CONFIG["hidden_size"]).astype(np.float32)
    mask = (np.arange(21) >= np.arange(4)[:, None]).astype(np.int64)
    with torch.no_grad():
        want = theirs(torch.tensor(x), attention_mask=torch.tensor(mask)).numpy()
    for scan in (None, recurrent_scan):
        got, _ = ours(jnp.asarray(x), jnp.asarray(mask > 0), scan=scan)
        np.testing.assert_allclose(np.asarray(got) * mask[..., None], want * mask[..., None],
                                   atol=1e-4)


def test_nemotron_hs_mamba2_layer_with_its_floor_on_dt_equals_transformers():
    """Nemotron-H's Mamba2 mixer as the zoo reads its config (``nemotron_h.read_layers``: heads
    of ``mamba_head_dim``, d_inner 48 apart from expand * hidden, the gated norm over
    ``n_groups``, biased projections, ``dt`` clipped below at ``time_step_min``: 1.5 here, which
    most tokens' dt meet) over the left-padded batch: the chunked scan gives transformers'
    outputs within 1e-4 (the recurrent one takes the same clipped dt: the test above)."""
    from transformers.models.nemotron_h import modeling_nemotron_h as hf

    from redco_zoo_models.nemotron_h import read_layers
    config = dict(TINY_FAMILIES["nemotron-h"], time_step_min=1.5)
    torch.manual_seed(0)
    theirs = jiggle_torch(hf.NemotronHMamba2Mixer(transformers.AutoConfig.for_model(
        config.pop("model_type"), **config), 0))
    ours = with_weights(Mamba2(read_layers(config)["mamba"], nnx.Rngs(0)), theirs)
    x = np.random.RandomState(0).randn(4, 21, config["hidden_size"]).astype(np.float32)
    mask = (np.arange(21) >= np.arange(4)[:, None]).astype(np.int64)
    with torch.no_grad():
        want = theirs(torch.tensor(x), attention_mask=torch.tensor(mask)).numpy()
    got, _ = ours(jnp.asarray(x), jnp.asarray(mask > 0))  # (the floor precedes either scan)
    np.testing.assert_allclose(np.asarray(got) * mask[..., None], want * mask[..., None],
                               atol=1e-4)


def test_a_prompt_then_token_by_token_through_the_state_equals_transformers():
    """The first 13 tokens read into an empty decoding state (chunks of 8), then 8 one at a
    time from the state they leave: transformers' outputs over all 21 at once."""
    theirs, ours = layer_pair(8)
    x = np.random.RandomState(1).randn(2, 21, CONFIG["hidden_size"]).astype(np.float32)
    with torch.no_grad():
        want = theirs(torch.tensor(x)).numpy()
    out, cache = ours(jnp.asarray(x[:, :13]), cache=init_cache(2, ours.cfg))
    outs = [out]
    for i in range(13, 21):
        out, cache = ours(jnp.asarray(x[:, i:i + 1]), cache=cache)
        outs.append(out)
    np.testing.assert_allclose(np.concatenate(outs, 1), want, atol=1e-4)
