"""Packed rows: several documents in one row, told apart by ``segment_ids``, compute exactly
what each document computes alone (attention never crosses a boundary, positions restart per
document), and the LM loss leaves out the prediction across a boundary and the padding."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from redco_zoo_lm.pipeline import collate_fn, loss_fn
from redco_zoo_models import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, split_model
from redco_zoo_models.attention import segment_positions

VOCAB = 64
MODELS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2), rngs=nnx.Rngs(0)),
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32,
                                               n_layer=2, n_head=4), rngs=nnx.Rngs(0)),
}


def packed(docs: list[np.ndarray], width: int) -> tuple[np.ndarray, np.ndarray]:
    """``docs`` end to end in a row of ``width`` tokens, padded with segment 0."""
    ids = np.concatenate(docs)
    segments = np.concatenate([np.full(len(d), i + 1) for i, d in enumerate(docs)])
    pad = width - len(ids)
    return np.pad(ids, (0, pad)).astype(np.int32), np.pad(segments, (0, pad)).astype(np.int32)


@pytest.mark.parametrize("name", MODELS)
def test_a_packed_row_computes_each_document_as_if_alone(name):
    apply_fn, params = split_model(MODELS[name]())
    apply_fn = jax.jit(apply_fn)  # (one compile per length beats dispatching op by op)
    rng = np.random.default_rng(0)
    rows = [[rng.integers(1, VOCAB, n) for n in lengths] for lengths in ([5, 9, 3], [12, 7])]
    ids, segments = map(np.stack, zip(*(packed(docs, 20) for docs in rows)))
    logits = apply_fn(params, jnp.asarray(ids), segment_ids=jnp.asarray(segments))
    for r, docs in enumerate(rows):
        start = 0
        for doc in docs:
            alone = apply_fn(params, jnp.asarray(doc[None], jnp.int32))[0]
            np.testing.assert_allclose(logits[r, start:start + len(doc)], alone, atol=1e-5,
                                       rtol=0, err_msg=f"{name}, row {r}, tokens {start}..")
            start += len(doc)


def test_positions_restart_in_each_segment():
    segments = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0], [4, 4, 4, 4, 4, 4, 4, 4]])
    assert segment_positions(segments).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1],
                                                    [0, 1, 2, 3, 4, 5, 6, 7]]


def test_a_packed_loss_is_the_documents_own_losses_and_ignores_padding():
    """The loss of a packed row is the token-weighted mean of each document's loss computed
    alone: the prediction across a boundary and the padding count for nothing (and changing
    the padding changes neither the loss nor its gradient)."""
    apply_fn, params = split_model(MODELS["llama"]())
    state = type("State", (), {"apply_fn": staticmethod(apply_fn)})
    loss = jax.jit(lambda batch, p=params: loss_fn(None, state, p, batch, True))  # noqa: E731
    rng = np.random.default_rng(1)
    docs = [rng.integers(1, VOCAB, 6), rng.integers(1, VOCAB, 8)]
    ids, segments = packed(docs, 17)
    batch = collate_fn([{"token_ids": ids, "segment_ids": segments}])
    alone = [float(loss(collate_fn([{"token_ids": d}]))) for d in docs]
    want = sum(a * (len(d) - 1) for a, d in zip(alone, docs)) / sum(len(d) - 1 for d in docs)
    assert float(loss(batch)) == pytest.approx(want, abs=1e-5)

    padded_otherwise = {**batch, "input_ids": batch["input_ids"].copy()}
    padded_otherwise["input_ids"][0, 14:] = [7, 8, 9]
    grads = [jax.grad(lambda p, b=b: loss(b, p))(params) for b in (batch, padded_otherwise)]
    jax.tree.map(np.testing.assert_array_equal, *grads)


def test_segment_ids_with_a_cache_or_a_mask_are_refused():
    apply_fn, params = split_model(MODELS["llama"]())
    ids = jnp.ones((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="segment_ids pack documents"):
        apply_fn(params, ids, attention_mask=jnp.ones((1, 4)), segment_ids=jnp.ones((1, 4)))
