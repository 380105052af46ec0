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

from redco_zoo_models.engine import Engine
from redco_zoo_models.lora import add_lora, lora_layers
from redco_zoo_models.requests import Sampling
from redco_zoo_models.toy import TINY_FAMILIES, tiny_family

PROMPTS = [[5, 9, 2], [7, 1, 3, 3, 8, 4, 4, 12, 30], [11], [3, 6, 9, 12, 15, 18]]
NEW = 8


def test_engine_caches_the_latent_and_decodes_as_the_training_forward():
    """Two requests, then two more joining after three steps (3 rows: one waits for a free
    row); each one's greedy tokens are the forward pass's argmax over prompt + completion and
    its log-probabilities that forward's (fp32, 2e-5). The allocated cache holds
    ``kv_lora_rank + qk_rope_head_dim`` numbers per token in every layer."""
    model, config = tiny_family("deepseek-v3"), TINY_FAMILIES["deepseek-v3"]
    engine = Engine(model, nnx.state(model, nnx.Param), max_seqs=3, max_len=24)
    for layer in engine.cache:
        numbers = sum(x.size for x in jax.tree.leaves(layer))
        assert numbers == 3 * 24 * (config["kv_lora_rank"] + config["qk_rope_head_dim"])
    requests = [engine.submit(p, Sampling(max_tokens=NEW)) for p in PROMPTS[:2]]
    for _ in range(3):
        engine.step()
    requests += [engine.submit(p, Sampling(max_tokens=NEW)) for p in PROMPTS[2:]]
    engine.run_until_done(requests)
    forward = jax.jit(lambda ids: jax.nn.log_softmax(model(ids).astype(jnp.float32)))
    for prompt, request in zip(PROMPTS, requests):
        tokens = request.samples[0].tokens
        logprobs = np.asarray(forward(jnp.asarray([prompt + tokens]))[0, len(prompt) - 1:-1])
        assert tokens == logprobs.argmax(-1).tolist(), prompt
        np.testing.assert_allclose(request.samples[0].logprobs,
                                   logprobs[np.arange(NEW), tokens], atol=2e-5)


def test_a_lora_adapted_up_projection_is_absorbed_merged():
    """The variant without a query latent, RoPE in halves and values as wide as keys, LoRA on
    its ``kv_b_proj`` (the adapter nonzero): a prompt read into the cache and two tokens decoded
    from it give the forward pass's logits (fp32, 1e-5)."""
    model = add_lora(tiny_family("deepseek-v3-plain-q"), rank=2, targets=r"kv_b_proj/kernel$")
    adapted = lora_layers(model)
    assert len(adapted) == TINY_FAMILIES["deepseek-v3-plain-q"]["num_hidden_layers"]
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
