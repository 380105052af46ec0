"""The tiny Mixture-of-Experts decoder the planner's expert-parallel test trains: a Qwen3-MoE
shape whose 8 experts (wide: 512 each) hold ~97% of the params, so replicating them is what
does not fit, and splitting them over 8 devices (expert parallelism) is."""
from redco_zoo_models.toy import TINY_FAMILIES

MOE = dict(TINY_FAMILIES["qwen3-moe"], num_experts=8, moe_intermediate_size=509,
           mlp_only_layers=[], num_hidden_layers=2)


def moe_model(seed=0):
    """``(apply_fn, params)`` of the tiny MoE decoder, real weights, its layers unrolled
    (``scan_layers=False``): test_planner_experts.py's budget and all_to_all count are the
    unrolled step's (a scanned one's body holds one layer's; tests/zoo/test_scan_layers.py
    trains a scanned MoE model with expert parallelism)."""
    import dataclasses

    from flax import nnx

    from redco_zoo_models import LlamaConfig, LlamaForCausalLM, split_model
    cfg = dataclasses.replace(LlamaConfig.from_hf(MOE), scan_layers=False)
    return split_model(LlamaForCausalLM(cfg, nnx.Rngs(seed)))


def moe_loss(apply_fn):
    """``loss(params, batch)``: the zoo LM's loss, as the ``Trainer`` calls it."""
    import jax
    import jax.numpy as jnp

    from redco.train_step import TrainState
    from redco_zoo_lm import loss_fn

    def loss(params, batch):
        state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=None,
                           rng=jax.random.PRNGKey(0), apply_fn=apply_fn)
        return loss_fn(jax.random.PRNGKey(0), state, params, batch, True)
    return loss
