"""Built-in sharding rule sets: ``auto`` (the paper's two rules over ``mp``; ``auto-names``
reads them off parameter names only, never the dataflow), ``fsdp``
(ZeRO-3 style over ``dp``, and ``cp`` with context parallelism), ``auto+fsdp`` (both, on a 2-D
layout), ``replicate``, and expert parallelism on top of the first two: ``auto+ep`` and
``auto+fsdp+ep``.

**Expert parallelism** (``+ep``): a Mixture-of-Experts model's stacked expert weights, a leaf
``.../experts/<name>`` of 3 dims (experts, in, out) or, a bias, 2 (experts, out), are split
on the experts over ``dp``
(device j holds experts ``j*E/dp .. (j+1)*E/dp - 1``), their other dims as the base rule set
puts them less the FSDP axes; every other param as the base rule set puts it. A model whose
MoE blocks read where their experts lie (``redco.fsdp.declared``; the zoo's,
``redco_zoo_models.expert_parallel``) then sends each token to its experts' devices
(``all_to_all``) instead of gathering the experts. Under ``auto`` (and so every set built on
it) the experts' tensor-parallel split comes from their names where the dataflow walker leaves
them whole (it does not follow their batched matmuls): gate and up projections on their
output, down on their input, as a dense MLP's (``expert_tp_spec``). ``has_experts`` says whether a model has
any (the layout planner tries the ``+ep`` sets only then).

**Stacked layers** (``redco.layer_stacks``: a scanned model's ``.../0:32/...`` params, layers on
the first axis) are given the specs of one layer's weight, read off its slice: the dataflow's
split dim less the layer axis, the names' and FSDP's on the dims after it (``layer_leaves``).
``redco.sharding`` puts the layer axis back in front, unsplit. So expert parallelism splits a
stack of experts (layers, experts, in, out) on its experts, the layer axis whole."""
from __future__ import annotations

import math
import re
import warnings

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from redco.dataflow import dataflow_split_dims
from redco.fsdp import FSDP_AXES, without_axes
from redco.layer_stacks import layer_shape, layers_of
from redco.plugins import hookimpl
from redco.sharding import Rules, named_leaves

QKV = re.compile(r"(^|/)(q|k|v|query|key|value|[qkv]_proj|qkv|wq|wk|wv)/(kernel|weight)$")
ATTN_OUT = re.compile(r"(^|/)(o|out|o_proj|out_proj|wo)/(kernel|weight)$")
FFN_IN = re.compile(r"(^|/)(gate|up|gate_proj|up_proj|w1|w3|wi|wi_0|wi_1|fc1|fc_in|c_fc|"
                    r"dense_h_to_4h)/(kernel|weight)$")
FFN_OUT = re.compile(r"(^|/)(down|down_proj|w2|fc2|fc_out|dense_4h_to_h)/(kernel|weight)$")
EMBEDDING = re.compile(r"(embed|embedding|wte|tok_embeddings)")
EXPERTS = re.compile(r"(^|/)experts/[^/]+$")  # stacked (experts, ...): expert parallelism
EXPERT_IN = re.compile(r"(^|/)experts/(gate|up|gate_proj|up_proj|w1|w3)(_bias)?$")
EXPERT_OUT = re.compile(r"(^|/)experts/(down|down_proj|w2)$")
COLUMN, ROW = P(None, "mp"), P("mp", None)
FSDP_MIN_SIZE = 1024  # params with fewer elements stay replicated: not worth a gather


def natural_key(path: str):
    """Sort ``Dense_2`` before ``Dense_10``: compare digit runs as numbers."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path)]


def layer_leaves(params) -> list[tuple[str, jax.ShapeDtypeStruct]]:
    """``named_leaves`` with each stacked param (``redco.layer_stacks``) as one layer's slice."""
    return [(path, jax.ShapeDtypeStruct(layer_shape(path, leaf.shape), leaf.dtype))
            for path, leaf in named_leaves(params)]


def exact(specs: dict[str, P]) -> Rules:
    return [(f"^{re.escape(path)}$", spec) for path, spec in specs.items() if spec != P()]


def auto_specs(params, mesh: Mesh, trace_fn=None) -> dict[str, P]:
    """The paper's two rules, as a spec per parameter path.

    With ``trace_fn`` (``params -> model outputs``) the rules follow the model's dataflow
    (``redco.dataflow``): every kernel's input and output dims and its place in a column/row
    pair come from the computation itself. Without it, from parameter names and order:

    1. Fully connected kernels alternate column split (output dim) and row split (input dim).
       Known feed-forward names (``gate_proj``/``up_proj`` then ``down_proj``, ``fc1`` then
       ``fc2``, ...) get their place in the pair directly; other kernels alternate in natural
       path order (``Dense_2`` before ``Dense_10``), restarting in every parent module.
    2. Attention Q, K, V split on the heads (output) side; the output projection on its input.
    Embedding tables split on the vocabulary; biases, norms and scalars are replicated.
    """
    if trace_fn is not None:
        leaves = named_leaves(params)
        split_dims, indivisible = dataflow_split_dims(trace_fn, params, mesh.shape["mp"])
        if indivisible:
            warnings.warn(f"These params do not divide by n_model_shards={mesh.shape['mp']} on "
                          "the dim their dataflow splits (or the heads it is cut into) and are "
                          "replicated instead: " +
                          "; ".join(f"{leaves[i][0]} {tuple(leaves[i][1].shape)} dim {d}"
                                    for i, d in indivisible.items()) +
                          ". To split them, pick an n_model_shards that divides those dims (and "
                          "the number of heads), or pad them, e.g. a vocabulary to a multiple of "
                          "128.", stacklevel=3)
        return {path: P() if split_dims.get(i) is None else _split_at(path, leaf, split_dims[i])
                for i, (path, leaf) in enumerate(leaves)}
    specs, n_dense = {}, {}
    for path, leaf in sorted(layer_leaves(params), key=lambda kv: natural_key(kv[0])):
        if len(leaf.shape) != 2:
            specs[path] = P()
        elif QKV.search(path) or FFN_IN.search(path):
            specs[path] = COLUMN
        elif ATTN_OUT.search(path) or FFN_OUT.search(path) or EMBEDDING.search(path):
            specs[path] = ROW
        else:
            parent = path.rsplit("/", 2)[0] if path.count("/") >= 2 else ""
            specs[path] = COLUMN if n_dense.get(parent, 0) % 2 == 0 else ROW
            n_dense[parent] = n_dense.get(parent, 0) + 1
    return specs


def _split_at(path: str, leaf, dim: int) -> P:
    """``mp`` on ``dim`` of a param, as one layer's spec for a stacked one (``dim`` counted
    with its layer axis, which a scan's slices never split)."""
    ndim, first = len(leaf.shape), int(layers_of(path) is not None)
    if dim < first:
        raise AssertionError(f"the dataflow split {path}'s layer axis")
    return P(*["mp" if d == dim else None for d in range(first, ndim)])


def fsdp_axes(mesh: Mesh) -> tuple[str, ...]:
    """The axes FSDP splits weights over: ``dp``, and ``cp`` too where the mesh has one (the
    devices splitting a sequence hold the same weights, so they share them out as well)."""
    return tuple(axis for axis in FSDP_AXES if axis in mesh.axis_names)


def with_fsdp(spec: P, shape: tuple[int, ...], mesh: Mesh) -> P:
    """``spec`` with the FSDP axes (``fsdp_axes``) added on the largest dim that is free and
    divisible by their size."""
    axes = fsdp_axes(mesh)
    n = math.prod(mesh.shape[axis] for axis in axes)
    entries = list(spec) + [None] * (len(shape) - len(spec))
    free = [d for d, axis in enumerate(entries) if axis is None and shape[d] % n == 0]
    if n == 1 or not free or math.prod(shape) < FSDP_MIN_SIZE:
        return spec
    entries[max(free, key=lambda d: shape[d])] = axes[0] if len(axes) == 1 else axes
    return P(*entries)


def auto_rules(params, mesh: Mesh, trace_fn=None) -> Rules:
    return exact(_auto(params, mesh, trace_fn))


def _auto(params, mesh: Mesh, trace_fn=None) -> dict[str, P]:
    """``auto_specs`` (none at mp=1), expert weights the dataflow left whole split by name, and
    expert biases always by name (``auto_specs`` would read one as an (in, out) matrix)."""
    mp = mesh.shape["mp"]
    if mp == 1:
        return {}
    specs = auto_specs(params, mesh, trace_fn)
    for path, leaf in layer_leaves(params):
        whole = "mp" not in jax.tree.leaves(tuple(specs.get(path, P())))
        if _is_expert(path, leaf) and (whole or len(leaf.shape) == 2):
            specs[path] = expert_tp_spec(path, leaf.shape, mp)
    return specs


def expert_tp_spec(path: str, shape: tuple[int, ...], mp: int) -> P:
    """Tensor parallelism of a stacked expert weight (experts, in, out), as of a dense MLP: a
    gate or up projection split on its output (column), a down projection on its input (row);
    replicated where that dim does not divide by ``mp``, or the name is neither. A gate or up
    projection's bias (experts, out) is split as its output; a down projection's is not."""
    dim = len(shape) - 1 if EXPERT_IN.search(path) else 1 if EXPERT_OUT.search(path) else None
    if dim is None or shape[dim] % mp:
        return P()
    return P(*["mp" if d == dim else None for d in range(len(shape))])


def auto_names_rules(params, mesh: Mesh, trace_fn=None) -> Rules:
    """``auto`` from parameter names and order only, never tracing the model (``trace_fn`` is
    ignored): for a model the dataflow walker cannot follow."""
    return auto_rules(params, mesh)


def fsdp_rules(params, mesh: Mesh, trace_fn=None) -> Rules:
    """Every large parameter (and so its optimizer state) split over the data-parallel devices
    and gathered for compute by XLA: ZeRO-3 without any code in the model."""
    return exact({path: with_fsdp(P(), leaf.shape, mesh) for path, leaf in layer_leaves(params)})


def auto_fsdp_rules(params, mesh: Mesh, trace_fn=None) -> Rules:
    """``auto`` over ``mp``, then ``fsdp`` over ``dp`` on a remaining dim."""
    return exact(_auto_fsdp(params, mesh, trace_fn))


def _auto_fsdp(params, mesh: Mesh, trace_fn=None) -> dict[str, P]:
    specs = _auto(params, mesh, trace_fn)
    return {path: with_fsdp(specs.get(path, P()), leaf.shape, mesh)
            for path, leaf in layer_leaves(params)}


def has_experts(params) -> bool:
    """Whether ``params`` hold stacked expert weights (``EXPERTS``, 3 dims; their biases 2;
    one more for stacked layers, ``redco.layer_stacks``) that expert parallelism can split."""
    return any(_is_expert(path, leaf) for path, leaf in layer_leaves(params))


def _is_expert(path: str, leaf) -> bool:
    return bool(EXPERTS.search(path)) and len(leaf.shape) in (2, 3)


def with_experts_split(base_specs):
    """The rule set of ``base_specs`` (``params, mesh, trace_fn -> {path: spec}``) with every
    expert weight split on its experts over ``dp`` (module docstring)."""
    def rules(params, mesh: Mesh, trace_fn=None) -> Rules:
        specs, dp = base_specs(params, mesh, trace_fn), mesh.shape["dp"]
        for path, leaf in layer_leaves(params):
            if not _is_expert(path, leaf):
                continue
            if leaf.shape[0] % dp:
                raise ValueError(
                    f"{path} holds {leaf.shape[0]} experts, which do not split over dp={dp} "
                    "devices for expert parallelism: use a data-parallel degree (devices / "
                    f"(n_model_shards x n_context_shards)) that divides {leaf.shape[0]}, or "
                    "rules without +ep.")
            specs[path] = P("dp", *list(without_axes(specs.get(path, P())))[1:])
        return exact(specs)
    return rules


@hookimpl(trylast=True)
def register_sharding_rules(register):
    register("auto", auto_rules)
    register("auto-names", auto_names_rules)
    register("fsdp", fsdp_rules)
    register("auto+fsdp", auto_fsdp_rules)
    register("replicate", lambda params, mesh, trace_fn=None: [])
    register("auto+ep", with_experts_split(_auto))
    register("auto+fsdp+ep", with_experts_split(_auto_fsdp))
