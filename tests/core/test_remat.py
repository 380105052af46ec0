"""``redco.remat`` on a model of plain functions: a layer marked with ``remat.layer`` is
recomputed in the backward pass (less memory, the same gradients), policies nest, and a
``Trainer(remat=...)`` whose loss marks no layer says it saves nothing."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import mlp_apply, mlp_collate, mlp_examples, mlp_init, mlp_loss

from redco import Deployer, Trainer, remat


@remat.layer
def block(params, x):
    return x + jnp.tanh(jnp.sin(x @ params["w1"]) @ params["w2"])


def loss(params, x):
    for layer_params in params:
        x = block(layer_params, x)
    return jnp.mean(x ** 2)


def test_a_marked_layer_keeps_less_and_gives_the_same_gradients():
    keys = jax.random.split(jax.random.PRNGKey(0), 16)
    params = [{"w1": jax.random.normal(keys[2 * i], (64, 256)) / 8,
               "w2": jax.random.normal(keys[2 * i + 1], (256, 64)) / 16} for i in range(8)]
    x = jax.random.normal(keys[0], (256, 64))
    results = {}
    for policy in ("none", "full"):
        with remat.policy(policy):
            step = jax.jit(jax.value_and_grad(loss))
            results[policy] = (step.lower(params, x).compile().memory_analysis().temp_size_in_bytes,
                               step(params, x))
    (none, ref), (full, out) = results["none"], results["full"]
    assert full < 0.5 * none, (none, full)  # 8 layers' activations against one layer's
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_policies_nest_and_unknown_ones_are_refused():
    assert remat.current() == "none"
    with remat.policy("full"):
        with remat.policy(None):  # keeps the policy in force
            assert remat.current() == "full"
        with remat.policy("dots_saveable"):
            assert remat.current() == "dots_saveable"
        assert remat.current() == "full"
    assert remat.current() == "none"
    with pytest.raises(ValueError, match="'ful'.*use one of.*dots_saveable.*full.*none"):
        remat.policy("ful")


def test_dots_saveable_keeps_a_fused_attention_kernels_forward(monkeypatch):
    """On a GPU the zoo's attention is cuDNN's flash attention, one JAX primitive that is not a
    ``dot_general``: ``"dots_saveable"`` and ``"dots_with_no_batch_dims_saveable"`` keep what its
    forward returns, so the backward pass does not run the kernel's forward again.
    Traced only: jax's cuDNN probes are told a version so the trace runs here; nothing
    compiles, the remat decision is JAX's own on its real primitive."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn
    monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(cudnn, "check_is_flash_attention", lambda *args, **kwargs: None)

    @remat.layer
    def attention_layer(w, x):
        q = x @ w
        return jax.nn.dot_product_attention(q, x, x, is_causal=True, implementation="cudnn")

    x = jnp.ones((2, 128, 4, 64), jnp.bfloat16)
    w = jnp.ones((64, 64), jnp.bfloat16)
    forwards = {}
    for name in ("dots_saveable", "dots_with_no_batch_dims_saveable"):
        with remat.policy(name):
            grad = jax.grad(lambda w: attention_layer(w, x).astype(jnp.float32).sum())
            text = str(jax.make_jaxpr(grad)(w))
        assert text.count("dot_product_attention_bwd") == 1
        forwards[name] = text.count("dot_product_attention_fwd")
    assert forwards == {"dots_saveable": 1, "dots_with_no_batch_dims_saveable": 1}


def mlp_trainer(workdir, policy):
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=workdir, verbose=False)
    return Trainer(deployer, mlp_collate, mlp_apply, mlp_loss, mlp_init(), optax.adamw(1e-2),
                   remat=policy)


def test_trainer_refuses_an_unknown_policy_and_warns_when_nothing_is_marked(workdir):
    with pytest.raises(ValueError, match="'ful'.*use one of.*dots_saveable.*full.*none"):
        mlp_trainer(workdir, "ful")
    trainer = mlp_trainer(workdir, "full")  # mlp_apply marks no layer
    with pytest.warns(UserWarning, match="remat='full'.*rematerialises nothing.*remat.layer"):
        trainer.eval_loss(mlp_examples(16), per_device_batch_size=2)  # decides the layout
