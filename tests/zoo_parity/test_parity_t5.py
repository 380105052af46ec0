"""The zoo's T5 against transformers' PyTorch T5 (v1.0: ReLU, tied head; flan-T5: gated GELU,
separate head): checkpoints both ways, logits on padded batches, greedy and beam search."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch  # installed by tox -e zoo-parity: missing is an error, not a skip
import transformers
from flax import nnx
from safetensors.numpy import load_file

from redco_zoo_models.generation import generate
from redco_zoo_models.hf import from_pretrained, save_pretrained
from redco_zoo_models.t5 import T5Config, T5ForConditionalGeneration

# attention's inner dim (4 * 6) != d_model; 8 buckets up to distance 16: exact and log buckets
SHAPE = dict(vocab_size=48, d_model=32, d_kv=6, d_ff=48, num_layers=2, num_heads=4,
             relative_attention_num_buckets=8, relative_attention_max_distance=16,
             decoder_start_token_id=0)
KINDS = {"t5": dict(feed_forward_proj="relu"),
         "flan": dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False)}


def torch_model(kind, seed=0, num_decoder_layers=3):
    torch.manual_seed(seed)
    cfg = transformers.T5Config(**SHAPE, num_decoder_layers=num_decoder_layers, **KINDS[kind])
    model = transformers.T5ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        if kind == "flan":  # transformers 5 ties lm_head to shared whatever the config says
            model.lm_head.weight = torch.nn.Parameter(torch.randn(SHAPE["vocab_size"],
                                                                  SHAPE["d_model"]))
        for name, p in model.named_parameters():
            if "layer_norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def jax_model(kind, seed=0, num_decoder_layers=3):
    kw = {"tie_word_embeddings": False} if kind == "flan" else {}
    cfg = T5Config(**SHAPE, num_decoder_layers=num_decoder_layers,
                   feed_forward_proj=KINDS[kind]["feed_forward_proj"], **kw)
    model = T5ForConditionalGeneration(cfg, nnx.Rngs(seed))
    params = nnx.state(model, nnx.Param)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    nnx.update(model, jax.tree.unflatten(
        tree, [x * (1 + 0.3 * jax.random.normal(k, x.shape)) for x, k in zip(leaves, keys)]))
    return model


def batch(seed=0):
    """Sources with right and left padding; decoder inputs with right padding."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(2, SHAPE["vocab_size"], (3, 11))
    mask = np.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, :3] = 0
    dec = rng.integers(2, SHAPE["vocab_size"], (3, 9))
    dec[:, 0] = 0
    dec_mask = np.ones_like(dec)
    dec_mask[2, 6:] = 0
    return ids, mask, dec, dec_mask


def torch_logits(model, ids, mask, dec, dec_mask):
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                    decoder_input_ids=torch.tensor(dec),
                    decoder_attention_mask=torch.tensor(dec_mask))
    return out.logits.numpy()


def jax_logits(model, ids, mask, dec, dec_mask):
    return np.asarray(model(jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(dec),
                            jnp.asarray(dec_mask)))


@pytest.mark.parametrize("kind", KINDS)
def test_transformers_checkpoint_loads_with_the_same_logits(kind, tmp_path):
    theirs = torch_model(kind)
    theirs.save_pretrained(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = from_pretrained(T5ForConditionalGeneration, str(tmp_path))
    assert not [w for w in caught if "unused" in str(w.message)]
    assert ours.cfg.tie_word_embeddings == (kind == "t5")
    for inputs in (batch(0), batch(1)):
        np.testing.assert_allclose(jax_logits(ours, *inputs), torch_logits(theirs, *inputs),
                                   atol=1e-4, rtol=1e-4)
    save_pretrained(ours, str(tmp_path / "again"))  # the same tensors as transformers writes
    assert (set(load_file(tmp_path / "again" / "model.safetensors"))
            == set(load_file(tmp_path / "model.safetensors")))


@pytest.mark.parametrize("kind", KINDS)
def test_our_checkpoint_loads_in_transformers_with_the_same_logits(kind, tmp_path):
    ours = jax_model(kind)
    save_pretrained(ours, str(tmp_path))
    theirs, info = transformers.T5ForConditionalGeneration.from_pretrained(
        tmp_path, output_loading_info=True)
    theirs.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    assert (theirs.lm_head.weight is theirs.shared.weight) == (kind == "t5")
    for inputs in (batch(0), batch(1)):
        np.testing.assert_allclose(torch_logits(theirs, *inputs), jax_logits(ours, *inputs),
                                   atol=1e-4, rtol=1e-4)


def assert_same_tokens(ours, theirs, eos):
    """``theirs`` starts with the decoder start token and, past an end, repeats EOS or pads
    (transformers fills with ``pad_token_id or eos``, so with pad 0, EOS); ours pads with 0."""
    theirs = theirs[:, 1:]
    for mine, hf in zip(ours, theirs):
        ends = np.flatnonzero(mine == eos)
        n = ends[0] + 1 if len(ends) else len(mine)
        np.testing.assert_array_equal(mine[:n], hf[:n])
        assert (mine[n:] == 0).all()


# transformers' generate with num_decoder_layers != num_layers fails (its DynamicCache gets the
# encoder's layer count), so generation uses equal stacks
@pytest.mark.parametrize("kind", ["t5", pytest.param("flan", marks=pytest.mark.slow)])
@pytest.mark.parametrize("num_beams", [1, 3])
def test_generation_matches_transformers(kind, num_beams, tmp_path):
    """flan-T5's cases are slow-tier repeats of the same decoding and beam search: in CI its
    gated GELU and separate head are guarded by
    test_transformers_checkpoint_loads_with_the_same_logits[flan], its decoding by the t5
    cases (one cache and search for both)."""
    ours = jax_model(kind, num_decoder_layers=2)
    params = nnx.state(ours, nnx.Param)
    save_pretrained(ours, str(tmp_path))
    theirs = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path).eval()
    ids, mask = (np.concatenate(x) for x in zip(batch(0)[:2], batch(1)[:2]))
    compiled = jax.jit(lambda params, eos: generate(  # once: the EOS id is traced
        ours, params, jnp.zeros((len(ids), 1), jnp.int32), 8, num_beams=num_beams,
        encoder_inputs={"input_ids": jnp.asarray(ids), "attention_mask": jnp.asarray(mask)},
        eos_token_id=eos, pad_token_id=0, length_penalty=1.0))
    run = lambda eos: np.asarray(compiled(params, eos))  # noqa: E731
    # T5's EOS (1) and a token the model emits third in row 0 (-1: no token ends a row), so
    # that some rows end early
    for eos in (1, int(run(-1)[0, 2])):
        with torch.no_grad():
            expected = theirs.generate(
                input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), do_sample=False,
                max_new_tokens=8, num_beams=num_beams, length_penalty=1.0, eos_token_id=eos,
                pad_token_id=0).numpy()
        assert_same_tokens(run(eos), expected, eos)
