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


def one_head_lm(seed=0, abstract=True):
    """A 2-layer LLaMA with one attention head (``apply_fn``, params): tensor parallelism can
    split its MLP but not its attention scores, so a long sequence fits only split. Unrolled
    (``scan_layers=False``): test_planner_context.py's budget is its measured peaks' (scanned,
    ``"none"`` recomputes the scores: test_planner_scan.py plans that with cp=2)."""
    from flax import nnx

    from redco_zoo_models import LlamaConfig, LlamaForCausalLM, split_model
    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=1, num_key_value_heads=1, scan_layers=False)
    build = lambda: LlamaForCausalLM(cfg, rngs=nnx.Rngs(seed))
    return split_model(nnx.eval_shape(build) if abstract else build())


def one_head_plan_model():
    """``one_head_lm`` for ``redco plan --model planner_helpers:one_head_plan_model``: abstract
    params, a trace fn, and the next-token loss."""
    import jax.numpy as jnp

    from redco_planner.models import lm_loss
    apply_fn, params = one_head_lm()
    return params, lambda p: apply_fn(p, jnp.zeros((1, 8), jnp.int32)), lm_loss(apply_fn)
