"""Context parallelism's attention (``redco_zoo_models.context_parallel``): with the sequence
split over 2, 4 and 8 devices in the load-balanced layout, the all-gather and the ring strategy
give unsplit attention's output and gradients to 1e-5 in fp32, causal and packed (segment
ids), grouped-query heads included; the layout gives each device one early and one late chunk;
a length that does not split is refused naming the fix."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from redco_zoo_models.attention import attend, decoder_inputs
from redco_zoo_models.context_parallel import (
    attend_split,
    balance,
    balanced_order,
    sequence_parallel_attention,
    unbalance,
)

B, N, H, KV, D = 2, 32, 4, 2, 8


def inputs(seed=0):
    q, k, v = (jax.random.normal(key, (B, N, heads, D)) for key, heads in
               zip(jax.random.split(jax.random.PRNGKey(seed), 3), (H, KV, KV)))
    segments = np.ones((B, N), np.int32)
    segments[0, 11:25], segments[0, 25:] = 2, 0  # row 0: two documents, then padding
    return q, k, v, jnp.asarray(segments)


def unsplit(q, k, v, segments):
    _, allowed = decoder_inputs(B, N, segment_ids=segments)
    return attend(q, k, v, allowed)


def test_the_balanced_layout_gives_each_device_an_early_and_a_late_chunk():
    order = np.asarray(balanced_order(16, 4))  # 8 chunks of 2
    assert order.reshape(4, 4).tolist() == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11],
                                            [6, 7, 8, 9]]
    x = jnp.arange(3 * 16).reshape(3, 16)
    np.testing.assert_array_equal(unbalance(balance(x, 4), 4), x)
    with pytest.raises(ValueError, match=r"30 tokens does not split into 2 x 4 equal chunks .* "
                                         r"pad the rows to a multiple of 8"):
        balanced_order(30, 4)


@pytest.mark.parametrize("strategy, k", [
    ("all_gather", 2), ("ring", 8), *(pytest.param(strategy, k, marks=pytest.mark.slow)
                                      for strategy, k in (("all_gather", 4), ("all_gather", 8),
                                                          ("ring", 2), ("ring", 4)))])
def test_split_attention_equals_unsplit_attention_and_its_gradients(strategy, k):
    """Each strategy at the degrees CI runs (the slow tier: the rest of 2, 4 and 8, the same
    shard_map at another device count; ring at CP 4 in CI: the model trained with its padded
    rows split, test_padded_rows_train_with_their_sequence_split_as_on_one_device)."""
    q, k_, v, segments = inputs()
    mesh = Mesh(np.array(jax.devices()[:k]), ("cp",))
    split = jax.jit(lambda q, k_, v: sequence_parallel_attention(q, k_, v, segments, mesh,
                                                                 strategy=strategy))
    np.testing.assert_allclose(split(q, k_, v), unsplit(q, k_, v, segments), atol=1e-5)
    weights = jax.random.normal(jax.random.PRNGKey(9), (B, N, H, D))
    def loss(f):
        return jax.grad(lambda *qkv: jnp.sum(f(*qkv) * weights), argnums=(0, 1, 2))(q, k_, v)
    for got, want in zip(loss(split), loss(lambda *qkv: unsplit(*qkv, segments))):
        np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_split_attention_over_several_tiles_equals_unsplit_attention(strategy):
    """1,280 packed tokens over CP 2: each device's queries meet its keys in several tiles of
    512 (``redco_zoo_models.tiled_attention``); output and gradients still equal unsplit's."""
    n = 1280
    q, k_, v = (jax.random.normal(key, (1, n, heads, D)) for key, heads in
                zip(jax.random.split(jax.random.PRNGKey(3), 3), (H, KV, KV)))
    segments = jnp.asarray(np.repeat([1, 2, 3, 0], [450, 500, 300, 30])[None], jnp.int32)
    mesh = Mesh(np.array(jax.devices()[:2]), ("cp",))
    split = jax.jit(lambda q, k_, v: sequence_parallel_attention(q, k_, v, segments, mesh,
                                                                 strategy=strategy))
    whole = lambda q, k_, v: attend(q, k_, v, decoder_inputs(1, n, segment_ids=segments)[1])
    np.testing.assert_allclose(split(q, k_, v), whole(q, k_, v), atol=1e-5)
    weights = jax.random.normal(jax.random.PRNGKey(9), q.shape)
    def grads(f):
        return jax.grad(lambda *qkv: jnp.sum(f(*qkv) * weights), argnums=(0, 1, 2))(q, k_, v)
    for got, want in zip(grads(split), grads(whole)):
        np.testing.assert_allclose(got, want, atol=1e-5)


def split_attention_temp_bytes(n: int, k: int, strategy: str = "all_gather") -> int:
    """Temp bytes per device of split attention's forward and backward, compiled (nothing
    runs) for one sequence of ``n`` tokens laid out over ``k`` devices."""
    mesh = Mesh(np.array(jax.devices()[:k]), ("cp",))
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "cp"))
    shape = lambda heads: jax.ShapeDtypeStruct((1, n, heads, 64), jnp.float32, sharding=split)
    ids = jax.ShapeDtypeStruct((1, n), jnp.int32, sharding=split)
    seq = jax.sharding.PartitionSpec(None, "cp")
    attention = jax.shard_map(
        lambda q, k_, v, pos, seg: attend_split(q, k_, v, pos, pos, seg, seg, "cp", strategy),
        mesh=mesh, in_specs=(seq,) * 5, out_specs=seq)
    grad = jax.jit(jax.grad(lambda *a: jnp.sum(attention(*a)), argnums=(0, 1, 2)))
    program = grad.lower(shape(8), shape(8), shape(8), ids, ids).compile()
    return program.memory_analysis().temp_size_in_bytes


def test_a_devices_attention_memory_falls_with_the_degree_and_never_holds_its_scores():
    """16,384 tokens, 8 heads of 64: a device's temporaries fall from CP 2 to 4 to 8, and at
    CP 8 stay under half of its (N/8 x N x heads) float32 score matrix (1 GiB)."""
    temp = {k: split_attention_temp_bytes(16384, k) for k in (2, 4, 8)}
    assert temp[2] > temp[4] > temp[8], {k: f"{t / 2**20:.0f} MiB" for k, t in temp.items()}
    scores = 16384 // 8 * 16384 * 8 * 4
    assert temp[8] < scores / 2, f"{temp[8] / 2**20:.0f} MiB, scores {scores / 2**20:.0f} MiB"


def tiny_model(kind="llama"):
    """A tiny LLaMA (4 query, 2 key/value heads; ``llama-scan``: its layers stacked and
    scanned) or GPT-2."""
    from flax import nnx

    from redco_zoo_models import LlamaConfig, LlamaForCausalLM
    from redco_zoo_models.gpt2 import GPT2Config, GPT2LMHeadModel
    if kind.startswith("llama"):
        return LlamaForCausalLM(LlamaConfig(
            vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, scan_layers=kind == "llama-scan"),
            rngs=nnx.Rngs(0))
    return GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=64, n_embd=32, n_layer=2,
                                      n_head=4), nnx.Rngs(0))


def deployer_of(n_model_shards=1, n_context_shards=1, strategy="all_gather", one_device=False,
                rules="auto"):
    from redco import Deployer
    return Deployer(jax_seed=0, n_model_shards=n_model_shards, workdir=None, verbose=False,
                    n_context_shards=n_context_shards, context_strategy=strategy,
                    n_local_devices=1 if one_device else None, sharding_rules=rules)


def lm_trainer(n_model_shards=1, n_context_shards=1, strategy="all_gather", one_device=False,
               kind="llama", rules="auto", compute_dtype=None, padded=False):
    """A Trainer of ``tiny_model(kind)`` on ``redco_zoo_lm``'s collate and loss functions (with
    ``padded``, on ``padded_rows``' ones)."""
    import optax

    from redco import Trainer
    from redco_zoo_lm import collate_fn, loss_fn
    from redco_zoo_models import split_model
    apply_fn, params = split_model(tiny_model(kind))
    deployer = deployer_of(n_model_shards, n_context_shards, strategy, one_device, rules)
    collate_fn, loss_fn = (collate_padded, padded_loss) if padded else (collate_fn, loss_fn)
    # (SGD: each update is the gradient itself. Adam would blow GPT-2's key-bias gradients,
    # zero in exact arithmetic and ~1e-7 of rounding either way, up to full-size steps.)
    return Trainer(deployer, collate_fn, apply_fn, loss_fn, params, optax.sgd(0.5),
                   compute_dtype=compute_dtype)


def packed_rows(n=8, width=17, seed=0):
    """Rows of 17 tokens (16 inputs): two documents each, the second cut at a random place."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        cut = int(rng.integers(3, 14))
        rows.append({"token_ids": rng.integers(1, 32, width),
                     "segment_ids": np.array([1] * cut + [2] * (width - cut))})
    return rows


def padded_rows(n=8, width=17, seed=1):
    """Rows of 17 tokens and their ``mask``: padded on the left, on the right, or in between."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        n_pad, at = int(rng.integers(1, 9)), np.arange(width)
        real = [at >= n_pad, at < width - n_pad, (at < 4) | (at >= 4 + n_pad)][i % 3]
        rows.append({"token_ids": np.where(real, rng.integers(1, 32, width), 0), "mask": real})
    return rows


def collate_padded(rows):
    return {"input_ids": np.stack([r["token_ids"] for r in rows]).astype(np.int32),
            "attention_mask": np.stack([r["mask"] for r in rows])}


def padded_loss(rng, state, params, batch, is_training):
    """Next-token cross-entropy over the real tokens predicted from real tokens."""
    from redco_zoo_models.metrics import token_cross_entropy
    ids, mask = batch["input_ids"], batch["attention_mask"]
    logits = state.apply_fn(params, ids[:, :-1], attention_mask=mask[:, :-1])
    return token_cross_entropy(logits, ids[:, 1:], mask[:, 1:] & mask[:, :-1])


@functools.cache
def one_device(kind="llama"):
    """What the split runs are compared with (computed once per model kind): the params and
    eval loss of two updates of ``packed_rows()`` (4 a step) on one device."""
    rows, one = packed_rows(), lm_trainer(one_device=True, kind=kind)
    one.train_epoch(rows, 4, 0)
    assert one.step == 2
    return jax.device_get(one.params), one.eval_loss(rows, 4)


@pytest.mark.parametrize("kind, n_model_shards, n_context_shards, strategy, rules", [
    ("llama", 1, 8, "all_gather", "auto+fsdp"), ("llama", 2, 2, "ring", "auto+fsdp"),
    ("gpt2", 2, 2, "ring", "auto"),
    *(pytest.param(*case, marks=pytest.mark.slow) for case in (
        ("llama", 1, 2, "all_gather", "auto"), ("llama", 1, 4, "ring", "auto"),
        ("gpt2", 1, 4, "all_gather", "auto")))])
def test_a_model_trained_with_its_sequence_split_matches_one_device(
        kind, n_model_shards, n_context_shards, strategy, rules):
    """Two updates of a packed batch through Trainer (dp x cp x mp, FSDP over dp x cp): the
    same params and eval loss as on one device, to 1e-5 in fp32. In CI each strategy, each
    model kind, with and without FSDP and TP; the slow tier repeats them at other degrees (CP 4
    ring without TP: also test_padded_rows_train_with_their_sequence_split_as_on_one_device)."""
    rows = packed_rows()
    one_params, one_loss = one_device(kind)
    split = lm_trainer(n_model_shards, n_context_shards, strategy, kind=kind, rules=rules)
    assert split.deployer.mesh.shape["cp"] == n_context_shards
    split.train_epoch(rows, 4 // split.deployer.dp_size, 0)
    assert split.step == 2
    if rules == "auto+fsdp":  # the weights are shared out over the devices splitting a sequence
        specs = [str(spec) for _, spec in split.deployer.params_sharding_rules]
        assert any("'cp'" in spec for spec in specs), specs
    for a, b in zip(jax.tree.leaves(jax.device_get(split.params)), jax.tree.leaves(one_params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert split.eval_loss(rows, 4 // split.deployer.dp_size) == pytest.approx(one_loss,
                                                                                rel=1e-5)


def test_a_scanned_model_trains_with_its_sequence_split_as_unrolled_on_one_device():
    """Layers stacked and run under ``jax.lax.scan`` (dp 2 x cp 2 x mp 2, ring, FSDP): each
    scanned layer's attention runs in the split sequence's ``shard_map``, and two updates of a
    packed batch give every layer the params one device gives the unrolled model (1e-5)."""
    from redco import layer_stacks
    from redco.tree_paths import named_leaves
    rows = packed_rows()
    one_params, one_loss = one_device()
    split = lm_trainer(2, 2, "ring", kind="llama-scan", rules="auto+fsdp")
    split.train_epoch(rows, 2, 0)
    scanned = layer_stacks.unstack({p: np.asarray(x) for p, x in named_leaves(split.params)})
    unrolled = {p: np.asarray(x) for p, x in named_leaves(one_params)}
    assert any(":" in p for p, _ in named_leaves(split.params)), "nothing stacked"
    assert scanned.keys() == unrolled.keys()
    for path, want in unrolled.items():
        np.testing.assert_allclose(scanned[path], want, rtol=1e-5, atol=1e-5, err_msg=path)
    assert split.eval_loss(rows, 2) == pytest.approx(one_loss, rel=1e-5)


def test_padded_rows_train_with_their_sequence_split_as_on_one_device():
    """Rows padded on either side, given an ``attention_mask``: the padding is a segment of its
    own under the split (the model's attention runs in ``shard_map``), and two updates of the
    real tokens' loss equal one device's (1e-5, CP 4 ring)."""
    from redco import sequence_split
    rows = padded_rows()
    one, split = lm_trainer(one_device=True, padded=True), lm_trainer(1, 4, "ring", padded=True)
    one.train_epoch(rows, 4, 0)
    split.train_epoch(rows, 2, 0)
    batch = collate_padded(rows[:2])
    with sequence_split.splitting(split.deployer.mesh, "ring"):
        traced = jax.make_jaxpr(lambda p: padded_loss(None, split.state, p, batch, True))
        assert "shard_map" in str(traced(split.params))
    for a, b in zip(jax.tree.leaves(jax.device_get(split.params)),
                    jax.tree.leaves(jax.device_get(one.params))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_a_bfloat16_model_trains_with_its_sequence_split_as_on_one_device():
    """bf16 compute (the key/value gradients reduce-scattered in fp32): one update equals one
    device's bf16 update to bf16's rounding. (XLA's CPU compiler crashed compiling this step
    with the gradients reduce-scattered in bf16.)"""
    rows = packed_rows()
    one = lm_trainer(one_device=True, compute_dtype=jnp.bfloat16)
    split = lm_trainer(1, 4, compute_dtype=jnp.bfloat16)
    one.train_epoch(rows[:4], 4, 0)
    split.train_epoch(rows[:4], 2, 0)
    for a, b in zip(jax.tree.leaves(jax.device_get(split.params)),
                    jax.tree.leaves(jax.device_get(one.params))):
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kind, n_model_shards, n_context_shards, strategy", [
    ("llama", 1, 4, "all_gather"), ("gpt2", 2, 2, "ring")])
def test_generation_after_a_prompt_read_split_matches_one_device(
        kind, n_model_shards, n_context_shards, strategy):
    """Greedy generation after left-padded 32-token prompts through Predictor: each prompt is
    read with its sequence split over the cp devices (its attention in ``shard_map``) and the
    cache held split (a generated token's step leaves it so); the tokens and their
    log-probabilities equal one device's (1e-5, fp32)."""
    from flax import nnx

    from redco import Predictor, sequence_split
    from redco_zoo_models import generate, split_model
    from redco_zoo_models.context_parallel import cache_slots
    model = tiny_model(kind)
    _, params = split_model(model)
    rng = np.random.default_rng(0)
    prompts = []
    for n_pad in (0, 5, 13, 30):
        prompts.append({"ids": np.concatenate([np.zeros(n_pad, np.int32),
                                               rng.integers(1, 32, 32 - n_pad, np.int32)]),
                        "mask": np.arange(32) >= n_pad})

    def collate(rows):
        return {key: np.stack([r[key] for r in rows]) for key in ("ids", "mask")}

    def pred_fn(params, batch):
        return generate(model, params, batch["ids"], 6, prompt_mask=batch["mask"],
                        return_logprobs=True)
    split = deployer_of(n_model_shards, n_context_shards, strategy)
    got = Predictor(split, collate, pred_fn).predict(prompts, 2, params)
    want = Predictor(deployer_of(one_device=True), collate, pred_fn).predict(prompts, 4, params)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want):
        np.testing.assert_array_equal(tokens, want_tokens)
        np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-5)

    def read(params, ids, index):  # a prompt (index 0) or one more token into the cache
        with sequence_split.splitting(split.mesh, strategy):  # generate's 38 slots, split
            m, n_slots = nnx.merge(nnx.graphdef(model), params), cache_slots(38)
            return m.decode(ids, jnp.ones((4, n_slots), bool), m.init_cache(4, n_slots), index)[1]
    ids = jnp.ones((4, 32), jnp.int32)
    assert "shard_map" in str(jax.make_jaxpr(read, static_argnums=2)(params, ids, 0))
    token_step = jax.jit(read).lower(params, ids[:, :1], jnp.int32(32)).compile()
    assert all(c.spec[1] == "cp" for c in jax.tree.leaves(token_step.output_shardings)), \
        token_step.output_shardings


def test_a_split_no_model_can_serve_and_a_length_that_does_not_split_are_refused_early():
    import optax

    from redco import Deployer, Trainer
    deployer = Deployer(jax_seed=0, n_context_shards=2, workdir=None, verbose=False)

    def mlp_loss(rng, state, params, batch, is_training):
        return jnp.mean((batch["x"] @ params["w"]) ** 2)
    mlp = Trainer(deployer, lambda rows: {"x": np.stack([r["x"] for r in rows])}, None,
                  mlp_loss, {"w": jnp.ones((4, 1))}, optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"n_context_shards=2 splits the sequence over 2 devices, "
                                         r"but the model never asked how"):
        mlp.train_epoch([{"x": np.ones(4, np.float32)}] * 8, 2, 0)
    llama = lm_trainer(n_context_shards=4)
    rows = [dict(r, token_ids=r["token_ids"][:13], segment_ids=r["segment_ids"][:13])
            for r in packed_rows()]  # 12 inputs: not 2 x 4 chunks
    with pytest.raises(ValueError, match=r"12 tokens does not split into 2 x 4 equal chunks"):
        llama.train_epoch(rows, 2, 0)
    with pytest.raises(ValueError, match=r"n_context_shards=3 must be a positive integer "
                                         r"dividing the 4 devices left by n_model_shards=2"):
        Deployer(jax_seed=0, n_model_shards=2, n_context_shards=3, workdir=None, verbose=False)


def test_a_decoder_with_cross_attention_is_refused_a_split_sequence():
    from flax import nnx

    from redco import sequence_split
    from redco_zoo_models.gpt2 import GPT2Config, GPT2Model
    decoder = GPT2Model(GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                   add_cross_attention=True), nnx.Rngs(0))
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2, 1), ("dp", "cp", "mp"))
    with pytest.raises(ValueError, match=r"also attends to an encoder \(cross-attention\), which "
                                         r"it cannot serve: set n_context_shards=1"):
        with sequence_split.splitting(mesh):
            decoder(jnp.ones((1, 8), jnp.int32), encoder_hidden_states=jnp.ones((1, 4, 16)))
