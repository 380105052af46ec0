"""Sharding rules as data: a list of ``(regex, PartitionSpec)`` matched against parameter paths.

A parameter's path is its pytree keys joined by ``/`` (``decoder/layers/0/attn/q/kernel``);
the first rule whose regex matches anywhere in the path (``re.search``) gives its spec, and a
parameter no rule matches is replicated. A stacked layers' param (``redco.layer_stacks``:
``model/layers/0:32/self_attn/q_proj/kernel``, layers on its first axis) takes a spec written
for one layer on the dims after its layer axis; a spec that would split that axis is refused.
"""
from __future__ import annotations

import math
import re
import warnings

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from redco.layer_stacks import layer_spec
from redco.lora import follow_kernels
from redco.tree_paths import key_name, named_leaves, path_str  # noqa: F401 - public here too

Rules = list[tuple[str, P]]


class RuleSetRules(list):
    """Rules a rule set gave from parameter names alone (``deployer.get_sharding_rules(params)``
    without ``trace_fn``), behind the caller's ``overrides``. A plain list to print or edit (an
    edited copy is a plain list, used as given); passed unchanged to a ``Trainer``, they are
    replaced at the first batch by the rule set's rules read off the loss's dataflow."""

    def __init__(self, name_rules: Rules, overrides: Rules | None = None):
        super().__init__(list(overrides or []) + list(name_rules))
        self.overrides = list(overrides or [])
        self._given = list(self)


def is_rule_set(rules) -> bool:
    """Whether ``rules`` leave the choice to the deployer's rule set: None, or ``RuleSetRules``
    nobody edited in place."""
    return rules is None or (isinstance(rules, RuleSetRules) and list(rules) == rules._given)


def make_mesh(devices: list, n_model_shards: int, n_context_shards: int = 1) -> Mesh:
    """The ``('dp', 'mp')`` mesh over ``devices`` with ``mp = n_model_shards``; with
    ``n_context_shards > 1``, ``('dp', 'cp', 'mp')``: ``cp`` devices split each sequence."""
    n = len(devices)
    if not isinstance(n_model_shards, int) or n_model_shards < 1 or n % n_model_shards:
        raise ValueError(
            f"n_model_shards={n_model_shards!r} must be \"auto\" or a positive integer dividing "
            f"the number of devices ({n}). Use one of {[d for d in range(1, n + 1) if n % d == 0]}.")
    rest = n // n_model_shards
    if not isinstance(n_context_shards, int) or n_context_shards < 1 or rest % n_context_shards:
        raise ValueError(
            f"n_context_shards={n_context_shards!r} must be a positive integer dividing the "
            f"{rest} devices left by n_model_shards={n_model_shards}. Use one of "
            f"{[d for d in range(1, rest + 1) if rest % d == 0]}.")
    if n_context_shards == 1:
        return jax.make_mesh((rest, n_model_shards), ("dp", "mp"),
                             axis_types=(AxisType.Auto, AxisType.Auto), devices=devices)
    return jax.make_mesh((rest // n_context_shards, n_context_shards, n_model_shards),
                         ("dp", "cp", "mp"), axis_types=(AxisType.Auto,) * 3, devices=devices)


def spec_for(path: str, rules: Rules) -> P:
    for pattern, spec in rules:
        if isinstance(pattern, tuple):  # Redco 0.4.x: names, each a full match, consecutive
            pattern = "(^|/)" + "/".join(f"({name})" for name in pattern) + "(/|$)"
        if re.search(pattern, path):
            return spec
    return P()


def fits(shape, spec: P, mesh: Mesh) -> bool:
    """Whether every sharded dim of ``shape`` divides by the mesh axes it is split over."""
    if len(spec) > len(shape):
        return False
    for size, axes in zip(shape, spec):
        axes = (axes,) if isinstance(axes, str) else (axes or ())
        if size % math.prod(mesh.shape[a] for a in axes):
            return False
    return True


def specs_from_rules(params, rules: Rules | dict, mesh: Mesh):
    """A pytree of ``PartitionSpec`` like ``params``; ``rules`` may also be a dict of rules per
    top-level key of ``params`` (``None``: replicate that subtree).

    A spec that does not fit its tensor (a dim not divisible by the shard count, or more dims
    than the tensor has) falls back to replication, and one warning lists every such param.
    LoRA adapters (``redco.lora``) follow their kernel whatever the rules say: ``A`` [in, r]
    gets the kernel's input-dim entry, ``B`` [r, out] its output-dim entry.
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    specs, replicated = [], []
    for path, leaf in leaves:
        if isinstance(rules, dict):  # Redco 0.4.x: {top-level key: its rules, None: replicate}
            spec = spec_for(path_str(path[1:]), rules.get(key_name(path[0])) or [])
        else:
            spec = spec_for(path_str(path), rules)
        name = path_str(path)
        spec = layer_spec(name, spec, len(leaf.shape))
        if not fits(leaf.shape, spec, mesh):
            replicated.append(f"{name} {tuple(leaf.shape)} by {spec}")
            spec = P()
        specs.append(spec)
    if replicated:
        warnings.warn("These params do not divide by their sharding and are replicated "
                      "instead: " + "; ".join(replicated), stacklevel=2)
    names = [path_str(path) for path, _ in leaves]
    specs = list(follow_kernels(dict(zip(names, specs)),
                                {n: np.shape(leaf) for n, (_, leaf) in zip(names, leaves)}).values())
    return jax.tree_util.tree_unflatten(treedef, specs)


def opt_state_shardings(optimizer, params, params_shardings, mesh: Mesh):
    """Shardings of ``optimizer.init(params)``: a leaf whose path ends with a param's path and
    has its shape (Adam's ``mu``, ``nu``, ... also inside ``optax.multi_transform``'s masked
    states) is sharded like that param; the rest (step counts) is replicated. ``params`` may be
    abstract."""
    by_path = {path: (np.shape(p), s) for (path, p), (_, s) in
               zip(named_leaves(params), named_leaves(params_shardings))}
    replicated = NamedSharding(mesh, P())

    def sharding(path, leaf):
        parts = path_str(path).split("/")
        for i in range(len(parts)):
            shape, param_sharding = by_path.get("/".join(parts[i:]), (None, None))
            if shape == np.shape(leaf):
                return param_sharding
        return replicated
    return jax.tree_util.tree_map_with_path(sharding, jax.eval_shape(optimizer.init, params))


def shardings_from_specs(specs, mesh: Mesh):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))


def dataflow_trace(loss, batch_abstract):
    """A ``trace_fn(params)`` for the ``auto`` rules: ``loss`` on zeros of the batch shapes
    (only traced, never run)."""
    import jax.numpy as jnp

    def zeros(x):  # in the dtype jax holds it in (int64 labels are int32 without x64)
        return jnp.zeros(x.shape, jax.dtypes.canonicalize_dtype(x.dtype))
    return lambda params: loss(params, jax.tree.map(zeros, batch_abstract))
