"""The tiny LM the planner's tests train. A module of its own, not ``conftest.py``: pytest gives
every ``conftest.py`` outside a package the same module name, so ``from conftest import ...``
gets whichever test folder's conftest was loaded first when several run together."""
import numpy as np


def lm_model(seed=0):
    """A 2-layer LLaMA with 32-wide layers (redco_zoo_models), real weights."""
    from flax import nnx

    from redco_zoo_models import LlamaConfig, LlamaForCausalLM, split_model
    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    return split_model(LlamaForCausalLM(cfg, rngs=nnx.Rngs(seed)))


def lm_examples(n=32, seq_len=16):
    rng = np.random.default_rng(0)
    return [{"token_ids": (np.arange(seq_len + 1) * rng.integers(1, 4) + rng.integers(32)) % 32}
            for _ in range(n)]
