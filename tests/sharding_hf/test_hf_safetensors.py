"""A checkpoint in the ``safetensors`` format is a HuggingFace checkpoint for the zoo's models:
transformers' own loader reads the params of a trained zoo LLaMA and computes the same logits."""
import json
import os

import jax
import numpy as np
import optax
from flax import nnx

from redco import Deployer, Trainer
from redco_zoo_lm import collate_fn, loss_fn
from redco_zoo_models import LlamaConfig, LlamaForCausalLM, split_model


def test_transformers_loads_a_safetensors_checkpoint_of_a_zoo_llama(tmp_path):
    from transformers import FlaxLlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    apply_fn, params = split_model(LlamaForCausalLM(cfg, nnx.Rngs(0)))
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=str(tmp_path), verbose=False,
                        checkpoint_format="safetensors")
    trainer = Trainer(deployer, collate_fn, apply_fn, loss_fn, params, optax.adamw(1e-2))
    rng = np.random.default_rng(0)
    examples = [{"token_ids": rng.integers(0, 64, 17)} for _ in range(16)]
    trainer.fit(examples, 2, n_epochs=1, save_last_ckpt=True)  # 2 updates, then step_2

    state_dir = os.path.join(deployer.ckpt_dir, "step_2", "state")
    with open(os.path.join(state_dir, "config.json"), "w") as f:  # what save_pretrained writes
        json.dump(cfg.to_hf(), f)
    hf_model = FlaxLlamaForCausalLM.from_pretrained(state_dir)

    input_ids = rng.integers(0, 64, (2, 12))
    ours = apply_fn(jax.device_get(trainer.params), input_ids)
    theirs = hf_model(input_ids).logits
    assert np.abs(np.asarray(ours)).max() > 0.1
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), atol=1e-4, rtol=1e-4)
