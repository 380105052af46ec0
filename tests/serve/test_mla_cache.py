"""Multi-head latent attention's cache (``redco_zoo_models.mla``): the engine allocates the
latent alone, ``kv_lora_rank + qk_rope_head_dim`` numbers per token and layer, and what it
decodes from it (absorbed attention) is what the training forward (the up-projected form, no
cache) computes: greedy tokens and log-probabilities, as requests come and go; a LoRA-adapted
``kv_b_proj`` is absorbed merged. transformers' own greedy generation against ours with this
cache: ``tests/zoo_parity/test_parity_families.py``. About 10 s on 2 CPU cores."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from test_engine import engine_of, model_of

from redco import sequence_split
from redco.layer_stacks import layers_of
from redco.sharding import make_mesh
from redco_zoo_models import generate
from redco_zoo_models.engine_memory import cache_sharding
from redco_zoo_models.lora import add_lora, lora_layers
from redco_zoo_models.requests import Sampling
from redco_zoo_models.toy import TINY_FAMILIES, tiny_family

PROMPTS = [[5, 9, 2], [7, 1, 3, 3, 8, 4, 4, 12, 30], [11], [3, 6, 9, 12, 15, 18]]
NEW = 8


def test_engine_caches_the_latent_and_decodes_as_the_training_forward():
    """Two requests, then two more joining after three steps (3 rows: one waits for a free
    row); each one's greedy tokens are the forward pass's argmax over prompt + completion and
    its log-probabilities that forward's (fp32, 2e-5). The allocated cache holds
    ``kv_lora_rank + qk_rope_head_dim`` numbers per token in every layer; on a mesh its rows
    split over ``dp``, the latent whole on each ``mp`` device."""
    model, config = model_of("deepseek-v3"), TINY_FAMILIES["deepseek-v3"]
    engine = engine_of("deepseek-v3", 3, 32)  # (test_engine_paged's reference: one compile)
    for layer in engine.cache:
        numbers = sum(x.size for x in jax.tree.leaves(layer))
        assert numbers == 3 * 32 * (config["kv_lora_rank"] + config["qk_rope_head_dim"])
    placed = cache_sharding(make_mesh(jax.devices(), 2), model.init_cache(4, 8))  # dp 4 x mp 2
    specs = {sharding.spec for sharding in jax.tree.leaves(placed)}  # (a sharding per leaf)
    assert specs == {P("dp", None, None, None)}  # one shared latent: whole on each of mp
    requests = [engine.submit(p, Sampling(max_tokens=NEW)) for p in PROMPTS[:2]]
    for _ in range(3):
        engine.step()
    requests += [engine.submit(p, Sampling(max_tokens=NEW)) for p in PROMPTS[2:]]
    engine.run_until_done(requests)
    whole = [prompt + request.samples[0].tokens for prompt, request in zip(PROMPTS, requests)]
    width = max(map(len, whole))  # right-padded into one batch: causal, the padding unseen
    ids = jnp.asarray([row + [0] * (width - len(row)) for row in whole])
    forward = np.asarray(jax.nn.log_softmax(jax.jit(model)(ids).astype(jnp.float32)))
    for prompt, request, row in zip(PROMPTS, requests, forward):
        tokens = request.samples[0].tokens
        logprobs = row[len(prompt) - 1:len(prompt) - 1 + NEW]
        assert tokens == logprobs.argmax(-1).tolist(), prompt
        np.testing.assert_allclose(request.samples[0].logprobs,
                                   logprobs[np.arange(NEW), tokens], atol=2e-5)


def test_a_lora_adapted_up_projection_is_absorbed_merged():
    """The variant without a query latent, RoPE in halves and values as wide as keys, LoRA on
    its ``kv_b_proj`` (the adapter nonzero): a prompt read into the cache and two tokens decoded
    from it give the forward pass's logits (fp32, 1e-5)."""
    model = add_lora(tiny_family("deepseek-v3-plain-q"), rank=2, targets=r"kv_b_proj/kernel$")
    adapted = lora_layers(model)
    n_layers = sum(len(layers_of(path) or [path]) for path, _ in adapted)  # (stacks: several)
    assert n_layers == TINY_FAMILIES["deepseek-v3-plain-q"]["num_hidden_layers"]
    for _, layer in adapted:
        layer.lora_b.value = 0.5 * jnp.ones_like(layer.lora_b.value)
    graphdef, state = nnx.split(model)

    @jax.jit
    def cached_and_forward(state, ids):
        m, valid = nnx.merge(graphdef, state), jnp.ones(ids.shape, bool)
        logits, cache = m.decode(ids[:, :7], valid, m.init_cache(*ids.shape), 0)
        steps = [logits]
        for i in (7, 8):
            logits, cache = m.decode(ids[:, i:i + 1], valid, cache, i)
            steps.append(logits)
        return jnp.concatenate(steps, 1), m(ids)
    cached, forward = cached_and_forward(state, jnp.asarray(
        np.random.RandomState(0).randint(1, 60, (2, 9))))
    np.testing.assert_allclose(cached, forward, atol=1e-5)


def test_generation_with_the_prompt_read_split_over_devices_equals_one_devices():
    """Context parallelism (4-way, all-gather): a left-padded prompt read split (absorbed
    attention in ``shard_map``) into the latent cache, its slots split over ``cp``; greedy tokens
    equal, log-probabilities to 1e-5, against the unsplit run."""
    model = tiny_family("deepseek-v3")
    params = nnx.state(model, nnx.Param)
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(1, 4), ("dp", "cp"))
    ids = jnp.asarray(np.random.RandomState(1).randint(1, 60, (2, 16)))
    mask = jnp.asarray(np.arange(16)[None] >= np.array([[0], [5]]))

    def run(params, ids, mask):
        return generate(model, params, ids, 6, prompt_mask=mask, return_logprobs=True)
    want = jax.jit(run)(params, ids, mask)
    with sequence_split.splitting(mesh, "all_gather"):  # (a fresh function: traced anew)
        split = lambda *args: run(*args)  # noqa: E731
        assert "shard_map" in str(jax.make_jaxpr(split)(params, ids, mask))
        got = jax.jit(split)(params, ids, mask)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], atol=1e-5)
