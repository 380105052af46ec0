"""The zoo decoder's stacked layers (``DecoderConfig.scan_layers``, ``redco_zoo_models.layer_scan``):
the groups it stacks, training on 8 devices equal to the unrolled model's (the one
tests/zoo_parity checks against transformers) under the dataflow rules and under FSDP, rules
written for one layer applied to a stack, checkpoints in and out, and what is refused."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from scanned import check_equal_training, examples, params_of

from redco import fsdp, layer_stacks, remat
from redco.builtins.rules import has_experts
from redco.protocols import UsageError
from redco.sharding import make_mesh, specs_from_rules
from redco.tree_paths import named_leaves
from redco_zoo_models import (
    LlamaConfig,
    LlamaForCausalLM,
    from_pretrained,
    generate,
    save_pretrained,
)
from redco_zoo_models.layer_scan import Segment, segments
from redco_zoo_models.toy import TINY_FAMILIES

S, F = "sliding_attention", "full_attention"
LLAMA = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2)
MIXTRAL = LlamaConfig.from_hf(TINY_FAMILIES["mixtral"])  # 3 MoE layers of 4 experts


@pytest.mark.parametrize("kinds, want", [
    ("L" * 5, [Segment(0, 1, 5)]),  # LLaMA: one run of single layers
    ("SSSSSF" * 4 + "SS", [Segment(0, 6, 4), Segment(24, 1, 2)]),  # Gemma 3 at 26 layers
    ("DDDMMMMM", [Segment(0, 1, 3), Segment(3, 1, 5)]),  # DeepSeek-V3: dense, then MoE
    ("ABCA", [Segment(0, 1, 1), Segment(1, 1, 1), Segment(2, 1, 1), Segment(3, 1, 1)]),
])
def test_segments_cover_the_stack_with_its_repeating_groups(kinds, want):
    assert segments(list(kinds)) == want
    assert Segment(0, 6, 4).keys()[1] == "1:24:6" and Segment(24, 1, 1).keys() == ["24"]


def test_a_scanned_llama_trains_as_the_unrolled_one_on_dp4_mp2():
    """Dataflow rules (``auto``): the stacked projections are split on ``mp`` as the unrolled
    layers' are, never on the layer axis. Two layers a step of the scan (``scan_unroll``), so
    its 3 layers end on a step of one (the other scanned tests run one layer a step)."""
    specs, *_ = check_equal_training(dataclasses.replace(LLAMA, scan_unroll=2))
    assert specs["model/layers/0:3/self_attn/q_proj/kernel"] == P(None, None, "mp")
    assert specs["model/layers/0:3/self_attn/o_proj/kernel"] == P(None, "mp", None)


@pytest.mark.parametrize("rules", ["auto", "auto+fsdp+ep"])
def test_a_scanned_moe_model_trains_as_the_unrolled_one_on_dp4_mp2(rules):
    """Mixtral's 3 MoE layers, balancing loss included: the stacked experts (layers, experts,
    in, out) are split as one layer's, gate and up on their output; with expert parallelism
    (``auto+fsdp+ep``) on their 4 experts over dp too, the layer axis whole, and the scanned
    step sends tokens to them (``all_to_all``, in the scan's body) as the unrolled step does;
    the planner then tries the ``+ep`` rule sets on the stacks (``has_experts``)."""
    specs, _, trainer = check_equal_training(MIXTRAL, rules)
    ep = "dp" if rules.endswith("+ep") else None
    assert specs["model/layers/0:3/mlp/experts/gate_proj"] == P(None, ep, None, "mp")
    assert specs["model/layers/0:3/mlp/experts/down_proj"] == P(None, ep, "mp", None)
    assert ("all_to_all" in trainer.lower_train_step(examples()[:8], 2).as_text()) == bool(ep)
    assert has_experts(params_of(MIXTRAL, True)[1])


def body_constraints(jaxpr, in_scan=False) -> int:
    """``sharding_constraint`` equations inside ``lax.scan`` bodies of ``jaxpr``, sub-jaxprs
    (remat's checkpoint, custom VJPs) included."""
    count = 0
    for eqn in jaxpr.eqns:
        count += in_scan and eqn.primitive.name == "sharding_constraint"
        for sub in jax.core.jaxprs_in_params(eqn.params):
            count += body_constraints(sub, in_scan or eqn.primitive.name == "scan")
    return count


def test_fsdp_gathers_each_layer_inside_the_scan_and_trains_as_unrolled():
    """``auto+fsdp`` and ``full`` remat: the scanned step equals the unrolled one, its stacks
    are split over ``dp`` behind the layer axis, and the scan's body gathers its layer's slice
    of each of them: a split and a gathered constraint per weight (``fsdp.gather``)."""
    specs, *_ = check_equal_training(LLAMA, "auto+fsdp", "full")
    split = [p for p, s in specs.items() if layer_stacks.layers_of(p) and "dp" in str(s)]
    assert len(split) == 5  # q, o, gate, up, down (k, v of 512 and norms: too small to split)
    apply_fn, params = params_of(LLAMA, True)
    mesh = make_mesh(jax.devices(), 2)
    shardings = jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s),
                             jax.tree.unflatten(jax.tree.structure(params),
                                                [specs[p] for p, _ in named_leaves(params)]),
                             is_leaf=lambda x: isinstance(x, P))
    ids = jnp.zeros((8, 16), jnp.int32)

    def loss(params):  # declared as the Trainer declares them
        with fsdp.gathering(params, shardings):
            return apply_fn(params, ids, labels=ids)
    with remat.policy("full"):
        jaxpr = jax.make_jaxpr(loss)(params).jaxpr
    assert body_constraints(jaxpr) == 2 * len(split)


def test_rules_written_for_one_layer_apply_behind_the_layer_axis():
    """A ``(regex, spec)`` rule written for a layer's (in, out) kernel splits a stack's (in,
    out) dims; one of the stack's rank with None first is taken as given; one splitting the
    layer axis is refused, naming the param."""
    _, params = params_of(LLAMA, True)
    mesh = make_mesh(jax.devices(), 2)
    rules = [("q_proj/kernel", P(None, "mp")), ("down_proj/kernel", P("mp")),
             ("up_proj/kernel", P(None, None, "mp"))]
    specs = dict(named_leaves(specs_from_rules(params, rules, mesh)))
    assert specs["model/layers/0:3/self_attn/q_proj/kernel"] == P(None, None, "mp")
    assert specs["model/layers/0:3/mlp/down_proj/kernel"] == P(None, "mp")
    assert specs["model/layers/0:3/mlp/up_proj/kernel"] == P(None, None, "mp")
    with pytest.raises(UsageError, match="model/layers/0:3/self_attn/k_proj/kernel.*layer axis"):
        specs_from_rules(params, [("k_proj/kernel", P("mp", None, None))], mesh)


def gemma3_like(**changes) -> LlamaConfig:
    """Gemma 3's sliding pattern, 7 layers: groups (S, S, F) twice, stacked, then one alone."""
    return LlamaConfig.from_hf(dict(TINY_FAMILIES["gemma3"], num_hidden_layers=7,
                                    layer_types=[S, S, F, S, S, F, S], **changes))


@pytest.mark.parametrize("cfg", [LLAMA, gemma3_like()], ids=["llama", "gemma3"])
def test_checkpoints_round_trip_and_the_cache_path_equals_the_scan(cfg, tmp_path):
    """An unrolled model's checkpoint read stacked, with the unrolled logits; written back
    tensor for tensor as the unrolled model wrote it; and its KV-cache forward (scanned too,
    each group position's caches stacked: Gemma 3's groups of 3) gives the scan's logits."""
    apply_fn, params = params_of(cfg, False)
    unrolled = dataclasses.replace(cfg, scan_layers=False)
    graph = nnx.graphdef(nnx.eval_shape(lambda: LlamaForCausalLM(unrolled, nnx.Rngs(0))))
    save_pretrained(nnx.merge(graph, params), str(tmp_path / "unrolled"))
    scanned = from_pretrained(LlamaForCausalLM, str(tmp_path / "unrolled"), scan_layers=True)
    assert any(layer_stacks.layers_of(p) for p, _ in named_leaves(nnx.state(scanned)))
    save_pretrained(scanned, str(tmp_path / "scanned"))
    from safetensors.numpy import load_file
    want = load_file(str(tmp_path / "unrolled" / "model.safetensors"))
    got = load_file(str(tmp_path / "scanned" / "model.safetensors"))
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    ids = jnp.asarray(np.random.default_rng(1).integers(1, 63, (2, 12)))
    s_graph, s_params = nnx.split(scanned, nnx.Param)

    @jax.jit
    def logits(p, s_p):
        model = nnx.merge(s_graph, s_p)
        cached, _ = model(ids, cache=model.init_cache(2, 12))
        return apply_fn(p, ids), model(ids), cached
    ref, scan, cached = logits(params, s_params)
    np.testing.assert_allclose(scan, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cached, scan, rtol=1e-5, atol=1e-5)


def test_a_scanned_model_starts_from_the_unrolled_ones_weights():
    """Built from the same seed, the stacks hold the unrolled model's initial weights, layer
    by layer (each layer is built as unrolled, then stacked)."""
    def init(scan: bool):
        cfg = dataclasses.replace(LLAMA, num_hidden_layers=2, scan_layers=scan)
        state = jax.jit(lambda: nnx.state(LlamaForCausalLM(cfg, nnx.Rngs(0)), nnx.Param))()
        return layer_stacks.unstack({p: np.asarray(x) for p, x in named_leaves(state)})
    got, want = init(True), init(False)
    assert got.keys() == want.keys()
    for path in want:
        np.testing.assert_array_equal(got[path], want[path], err_msg=path)


def layer_bodies_traced(n_layers: int, scan: bool) -> int:
    """The matrix products in the program of ``generate`` (a prompt read into the cache, then
    tokens decoded one by one) for the tiny LLaMA at ``n_layers``: 9 a layer body traced (its 7
    projections, attention's 2), 1 the head's, per model call. Traced only
    (``jax.make_jaxpr``, abstract params), never compiled."""
    cfg = dataclasses.replace(LLAMA, num_hidden_layers=n_layers, scan_layers=scan)
    graph, params = nnx.split(nnx.eval_shape(lambda: LlamaForCausalLM(cfg, nnx.Rngs(0))))
    ids = jnp.ones((2, 5), jnp.int32)
    program = jax.make_jaxpr(lambda p: generate(nnx.merge(graph, p), p, ids, 3))(params)
    return str(program).count("dot_general")


def test_the_cache_path_traces_one_layer_body_per_run_whatever_the_depth():
    """With the layers scanned, ``generate``'s prefill and decode (the KV-cache path the engine
    runs too) trace the same program at 2 and 6 layers, so a server's warm-up compiles stay flat
    in depth; unrolled, each layer is traced again (bench/serve_startup.py times both)."""
    scanned = {n: layer_bodies_traced(n, True) for n in (2, 6)}
    unrolled = {n: layer_bodies_traced(n, False) for n in (2, 6)}
    assert scanned[2] == scanned[6] > 0, scanned
    assert unrolled[6] > 2 * unrolled[2] and unrolled[2] >= scanned[2], unrolled


def gradient_program(scan: bool, policy: str) -> list[str]:
    """The tiny LLaMA's loss gradient under remat ``policy`` (traced, not compiled): its loops'
    bodies (scanned; the layers' and the chunked loss's), else its whole program."""
    cfg = dataclasses.replace(LLAMA, num_hidden_layers=2, scan_layers=scan)
    graph, params = nnx.split(nnx.eval_shape(lambda: LlamaForCausalLM(cfg, nnx.Rngs(0))))
    ids = jnp.ones((2, 5), jnp.int32)

    def loss(p):
        return nnx.merge(graph, p)(ids, labels=ids)
    with remat.policy(policy):
        program = jax.make_jaxpr(jax.grad(loss))(params)
    loops = [str(e.params["jaxpr"]) for e in program.jaxpr.eqns if e.primitive.name == "scan"]
    return loops if scan else [str(program)]


def test_a_scanned_body_keeps_weight_matmul_outputs_under_the_default_policy():
    """Under ``"none"`` a scanned body keeps what ``remat.SCANNED_NONE`` keeps (matmuls against
    weights, attention's output: ``remat.scanned_body``, as a loop's residuals cannot be fused
    away); an unrolled layer keeps every residual; other policies stay as given."""
    kept = remat.SCANNED_NONE
    assert gradient_program(True, "none") == gradient_program(True, kept)
    assert gradient_program(False, "none") != gradient_program(False, kept)
    assert gradient_program(True, "dots_saveable") != gradient_program(True, kept)
