"""The three functions of causal language modelling."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax

from redco_zoo_models import generate


def collate_fn(examples: list[dict]) -> dict:
    """Examples hold equal-length ``token_ids``; the batch is ``input_ids`` (B, T)."""
    return {"input_ids": np.stack([np.asarray(e["token_ids"], np.int32) for e in examples])}


def loss_fn(rng, state, params, batch, is_training):
    """Mean next-token cross-entropy."""
    ids = batch["input_ids"]
    logits = state.apply_fn(params, ids[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()


def pred_fn(rng, params, batch, model, max_new_tokens: int = 64, temperature: float = 0.8):
    """Continue each row of ``input_ids`` by ``max_new_tokens`` sampled tokens (``model`` gives
    the structure; its weights are ``params``)."""
    return generate(model, params, batch["input_ids"], max_new_tokens, rng=rng,
                    temperature=temperature)
