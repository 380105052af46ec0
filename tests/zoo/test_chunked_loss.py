"""Next-token cross-entropy a chunk of tokens at a time (``redco_zoo_models.chunked_loss``):
the value and gradients of the loss over whole logits, for the zoo's LLaMA and GPT-2 through
``labels=``, with the sequence split over devices too, and never the whole logits in memory."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from redco import sequence_split
from redco.sharding import make_mesh
from redco_zoo_models import LlamaConfig, LlamaForCausalLM, split_model
from redco_zoo_models.chunked_loss import next_token_loss
from redco_zoo_models.gpt2 import GPT2Config, GPT2LMHeadModel


def whole_loss(hidden, head, labels, mask):
    """The reference: every logit materialised, optax's cross-entropy, the masked mean."""
    losses = optax.softmax_cross_entropy_with_integer_labels(hidden @ head, labels)
    return jnp.sum(losses * mask) / jnp.sum(mask)


@pytest.mark.parametrize("chunk", [7, 64])
def test_chunks_give_the_masked_mean_cross_entropy_and_its_gradients(chunk):
    """37 tokens in chunks of 7 (the last padded) or one chunk of 64: value and the gradients
    of the hidden states and the head within 1e-5 of whole logits'."""
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(2, 37, 16)), jnp.float32)
    head = jnp.asarray(rng.normal(size=(16, 50)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 50, (2, 37)), jnp.int32)
    mask = jnp.asarray(rng.random((2, 37)) > 0.3)
    chunked = lambda h, w: next_token_loss(h, w, labels, mask, chunk)
    whole = lambda h, w: whole_loss(h, w, labels, mask)
    np.testing.assert_allclose(chunked(hidden, head), whole(hidden, head), rtol=1e-6)
    for got, want in zip(jax.grad(chunked, (0, 1))(hidden, head),
                         jax.grad(whole, (0, 1))(hidden, head)):
        np.testing.assert_allclose(got, want, atol=1e-5)
    with pytest.raises(ValueError, match=r"labels \(2, 36\) .* shaped like the input ids "
                                         r"\(2, 37\).*labels=ids\[:, 1:\]"):
        next_token_loss(hidden, head, labels[:, 1:])


def tiny(kind: str):
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4,
                                            num_key_value_heads=2), rngs=nnx.Rngs(0))
    return GPT2LMHeadModel(GPT2Config(vocab_size=40, n_positions=64, n_embd=32, n_layer=2,
                                      n_head=4), nnx.Rngs(0))


def losses(apply_fn, ids, segments):
    """``(loss through labels=, loss through the logits)`` of packed rows: next tokens within
    their own document."""
    inputs, labels, seg = ids[:, :-1], ids[:, 1:], segments[:, :-1]
    mask = (segments[:, 1:] == seg) & (segments[:, 1:] != 0)
    through_labels = lambda p: apply_fn(p, inputs, segment_ids=seg, labels=labels,
                                        label_mask=mask)
    logits = lambda p: apply_fn(p, inputs, segment_ids=seg)
    through_logits = lambda p: jnp.sum(optax.softmax_cross_entropy_with_integer_labels(
        logits(p), labels) * mask) / jnp.sum(mask)
    return through_labels, through_logits


def packed(rows: int = 2, width: int = 33, seed: int = 0):
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(rng.integers(1, 40, (rows, width)), jnp.int32)
    segments = jnp.asarray(np.repeat([[1, 2, 0]], rows, 0).repeat([13, 17, 3], 1), jnp.int32)
    return ids, segments


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("n_context_shards", [1, 4])
def test_labels_give_the_loss_and_gradients_of_the_logits(kind, n_context_shards):
    """A tiny LLaMA or GPT-2 on packed rows: ``model(ids, labels=...)`` equals the masked
    cross-entropy of its logits, gradients of every param included (1e-5), on one device and
    with the sequence split over 4 (the chunks cut within each device's part)."""
    apply_fn, params = split_model(tiny(kind))
    ids, segments = packed()
    through_labels, through_logits = losses(apply_fn, ids, segments)
    want = jax.jit(jax.value_and_grad(through_logits))(params)
    mesh = make_mesh(jax.devices()[:n_context_shards], 1, n_context_shards)
    with sequence_split.splitting(mesh):
        got = jax.jit(jax.value_and_grad(through_labels))(params)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        np.testing.assert_allclose(g, w, atol=1e-5)


def test_the_backward_pass_never_holds_the_whole_logits():
    """8,192 tokens, 8,192 words: the gradient of the chunked loss holds under half of the
    (tokens x words) fp32 logits in temporaries; the whole-logits loss holds more than them."""
    hidden = jax.ShapeDtypeStruct((1, 8192, 64), jnp.float32)
    head = jax.ShapeDtypeStruct((64, 8192), jnp.float32)
    labels = jnp.zeros((1, 8192), jnp.int32)
    mask = jnp.ones((1, 8192), bool)

    def temp(loss):
        step = jax.jit(jax.grad(lambda h, w: loss(h, w, labels, mask), (0, 1)))
        return step.lower(hidden, head).compile().memory_analysis().temp_size_in_bytes
    logits = 8192 * 8192 * 4
    assert temp(whole_loss) > logits  # (the measure sees them)
    assert temp(next_token_loss) < logits / 2, f"{temp(next_token_loss) / 2**20:.0f} MiB"


def test_with_the_sequence_split_each_device_computes_its_own_tokens_logits():
    """4,096 tokens split over 4 devices, chunks of 512 (two per device): the compiled
    gradient step gathers no hidden states (each device's chunks are cut within its own part
    of the sequence); its only collective sums the head's gradient over the devices."""
    mesh = make_mesh(jax.devices()[:4], 1, 4)
    labels, mask = jnp.zeros((1, 4096), jnp.int32), jnp.ones((1, 4096), bool)
    step = jax.jit(jax.grad(lambda h, w: next_token_loss(h, w, labels, mask, 512), (0, 1)))
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "cp"))
    hidden = jax.ShapeDtypeStruct((1, 4096, 64), jnp.float32, sharding=split)
    head = jax.ShapeDtypeStruct((64, 4096), jnp.float32)
    with sequence_split.splitting(mesh):
        text = step.lower(hidden, head).compile().as_text()
    collectives = re.findall(r"= (\S+) (all-gather|all-reduce|reduce-scatter|all-to-all|"
                             r"collective-permute)\(", text)
    assert [op for _, op in collectives] == ["all-reduce"], collectives
    assert collectives[0][0].startswith("f32[4096,64]"), collectives  # the head's gradient
