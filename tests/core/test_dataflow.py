"""``auto`` rules from the model's dataflow: right whatever the names, order or layout."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import GLOBAL_BATCH, Recorder, lm_examples, lm_model, mlp_init, train
from jax.sharding import PartitionSpec as P

from redco import Deployer, Trainer, dataflow
from redco.builtins.rules import auto_rules
from redco.dataflow import reshape_dim_map
from redco.sharding import path_str
from redco_zoo_lm import collate_fn as lm_collate
from redco_zoo_lm import loss_fn as lm_loss
from redco_zoo_models import LlamaConfig, LlamaForCausalLM, split_model

COLUMN, ROW, REP = P(None, "mp"), P("mp", None), P()


def plan(deployer, params, trace_fn):
    rules = deployer.get_sharding_rules(params, trace_fn=trace_fn)
    specs = deployer.get_params_shardings(params, rules)
    return {path_str(p): s.spec for p, s in jax.tree_util.tree_flatten_with_path(specs)[0]}


@pytest.fixture
def deployer(workdir):
    return Deployer(jax_seed=0, n_model_shards=2, workdir=workdir, verbose=False)


def test_reshape_dim_map():
    assert reshape_dim_map((2, 8, 12), (2, 8, 3, 4)) == [0, 1, 2, None]  # split: major carries
    assert reshape_dim_map((2, 8, 3, 4), (2, 8, 12)) == [0, 1, 2]  # merge: major carries
    assert reshape_dim_map((1, 6), (6,)) == [1]


def test_names_and_order_do_not_matter(deployer):
    """Kernels named against their compute order (alphabetical order would get them wrong); the
    last one's output dim (1) does not divide 2 shards, so it is replicated with a warning."""
    key = iter(jax.random.split(jax.random.PRNGKey(0), 3))
    params = {name: jax.random.normal(next(key), shape) for name, shape in
              (("z_first", (8, 16)), ("a_second", (16, 16)), ("m_third", (16, 1)))}
    apply = lambda p, x: jnp.tanh(jnp.tanh(x @ p["z_first"]) @ p["a_second"]) @ p["m_third"]
    with pytest.warns(UserWarning,
                      match=r"replicated instead: m_third \(16, 1\) dim 1\. To split them, pick "):
        got = plan(deployer, params, lambda p: apply(p, jnp.zeros((1, 8))))
    assert got == {"z_first": COLUMN, "a_second": ROW, "m_third": REP}


def conv1d(p, x):
    """HuggingFace GPT-2's Conv1D: the kernel is stored (out, in) and transposed for use."""
    return jax.lax.dot_general(x, p["kernel"].T, (((x.ndim - 1,), (0,)), ((), ()))) + p["bias"]


def gpt2_block_params(d=32, vocab=64):
    key = iter(jax.random.split(jax.random.PRNGKey(0), 8))
    dense = lambda n_out, n_in: {"kernel": jax.random.normal(next(key), (n_out, n_in)) * 0.1,
                                 "bias": jnp.zeros(n_out)}
    return {"wte": {"embedding": jax.random.normal(next(key), (vocab, d)) * 0.1},
            "h": {"0": {"attn": {"c_attn": dense(3 * d, d), "c_proj": dense(d, d)},
                        "mlp": {"c_fc": dense(4 * d, d), "c_proj": dense(d, 4 * d)}}}}


def gpt2_apply(params, ids, n_heads=4):
    x = params["wte"]["embedding"][ids]
    block = params["h"]["0"]
    q, k, v = jnp.split(conv1d(block["attn"]["c_attn"], x), 3, axis=-1)  # fused QKV
    b, t, d = q.shape
    heads = [y.reshape(b, t, n_heads, d // n_heads) for y in (q, k, v)]
    x = x + conv1d(block["attn"]["c_proj"],
                   jax.nn.dot_product_attention(*heads, is_causal=True).reshape(b, t, d))
    x = x + conv1d(block["mlp"]["c_proj"], jax.nn.gelu(conv1d(block["mlp"]["c_fc"], x)))
    return x @ params["wte"]["embedding"].T  # tied LM head


def test_gpt2_conv1d_layout_fused_qkv_and_tied_head(deployer):
    got = plan(deployer, gpt2_block_params(), lambda p: gpt2_apply(p, jnp.zeros((1, 8), int)))
    attn, mlp = "h/0/attn/", "h/0/mlp/"
    assert got == {
        "wte/embedding": ROW,  # vocab, shared by the lookup and the tied head
        attn + "c_attn/kernel": ROW, attn + "c_attn/bias": P("mp"),  # (out, in): column
        attn + "c_proj/kernel": COLUMN, attn + "c_proj/bias": REP,  # row-parallel
        mlp + "c_fc/kernel": ROW, mlp + "c_fc/bias": P("mp"),
        mlp + "c_proj/kernel": COLUMN, mlp + "c_proj/bias": REP}


@pytest.mark.parametrize("tied,seq_len", [(False, 8), (True, 8), (False, 1100)])
def test_llama_gqa_plan(deployer, tied, seq_len):
    """At 1100 tokens attention runs in the tiled attention's ``lax.scan`` over key blocks (and
    its ``custom_vjp``): the walk follows the heads' split through the scan's body."""
    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                      scan_layers=False)
    apply_fn, params = split_model(LlamaForCausalLM(cfg, rngs=nnx.Rngs(0)))
    got = plan(deployer, params, lambda p: apply_fn(p, jnp.zeros((1, seq_len), jnp.int32)))
    for layer in ("model/layers/0/", "model/layers/1/"):
        for name in ("q_proj", "k_proj", "v_proj"):
            assert got[f"{layer}self_attn/{name}/kernel"] == COLUMN
        assert got[f"{layer}self_attn/o_proj/kernel"] == ROW
        assert got[f"{layer}mlp/gate_proj/kernel"] == got[f"{layer}mlp/up_proj/kernel"] == COLUMN
        assert got[f"{layer}mlp/down_proj/kernel"] == ROW
        assert got[f"{layer}input_layernorm/weight"] == REP
    assert got["model/embed_tokens/embedding"] == ROW
    assert tied or got["lm_head/kernel"] == COLUMN


def test_dataflow_plan_trains_like_one_device(workdir):
    examples = lm_examples(32)
    losses = []
    for n_model_shards, n_local in ((1, 1), (2, None)):
        deployer = Deployer(jax_seed=0, n_model_shards=n_model_shards, workdir=workdir,
                            n_local_devices=n_local, verbose=False)
        apply_fn, params = lm_model()
        rules = deployer.get_sharding_rules(
            params, trace_fn=lambda p: apply_fn(p, jnp.zeros((1, 8), jnp.int32)))
        recorder = Recorder()
        Trainer(deployer, lm_collate, apply_fn, lm_loss, params, optax.adamw(1e-2),
                params_sharding_rules=rules, callbacks=[recorder]).fit(
            examples, GLOBAL_BATCH // deployer.dp_size, n_epochs=2, resume=False)
        losses.append(recorder.losses)
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5, atol=1e-5)


def break_the_walker(monkeypatch) -> None:
    """The dataflow walker fails as it would on a jaxpr of a JAX it does not know."""
    def run(self, jaxpr, in_info):
        raise KeyError("some_new_primitive")
    monkeypatch.setattr(dataflow.Walker, "run", run)


def test_a_walker_that_fails_stops_fit_naming_jax_and_the_name_rules(workdir, monkeypatch):
    break_the_walker(monkeypatch)
    with pytest.raises(dataflow.DataflowError) as info:
        train("mlp", workdir, n_model_shards=2, n_epochs=1)
    message = str(info.value)
    assert f"could not follow this model's jaxpr on jax {jax.__version__} (KeyError: " in message
    assert "Deployer(sharding_rules='auto-names')" in message
    assert isinstance(info.value.__cause__, KeyError)


def test_auto_names_trains_on_the_rules_from_names_without_the_walker(workdir, monkeypatch):
    break_the_walker(monkeypatch)
    losses, _, trainer = train("mlp", workdir, n_model_shards=2, n_epochs=1,
                               sharding_rules="auto-names")
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), mlp_init())
    assert trainer.params_sharding_rules == auto_rules(abstract, trainer.deployer.mesh)
    assert trainer.params_sharding_rules and np.isfinite(losses).all()
