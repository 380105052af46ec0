"""The paper's two rules, read off the model's real dataflow instead of its parameter names.

Trace the model to a jaxpr and walk it once, tracking for every activation which of its dims
(if any) is split over ``mp``. At each matmul with a parameter:

* the activation's split dim is contracted -> the parameter is **row**-parallel (split on the
  matching input dim) and the output is whole again after XLA's all-reduce;
* otherwise -> **column**-parallel (split on its first output dim), so the output is split.

Attention follows: Q, K, V see whole activations (column); the head dim stays split through
the reshapes and the score/value matmuls; O contracts over it (row). Feed-forward pairs, fused
QKV kernels, transposed kernels (GPT-2's ``Conv1D``) and ``Dense_10`` after ``Dense_9`` all come
out right because only the computation counts. Embedding lookups split the vocabulary; a bias
or scale added to a split activation is split the same way; everything else is replicated.
"""
from __future__ import annotations

from typing import Any

import jax
from jax.extend import core as jex_core

Decisions = dict[int, int | None]  # param index -> param dim split over mp (None: replicate)
ELEMENTWISE_SKIP = {"gather", "scatter", "scatter-add", "dynamic_slice", "dynamic_update_slice",
                    "iota", "rng_bit_generator", "sort", "argsort", "cumsum", "while", "scan",
                    "cond"}


def reshape_dim_map(in_shape, out_shape) -> list[int | None]:
    """For each out dim, the in dim it carries (the major dim of a split or merged group)."""
    result: list[int | None] = [None] * len(out_shape)
    i = o = 0
    while i < len(in_shape) and o < len(out_shape):
        gi, go = [i], [o]
        pi, po = in_shape[i], out_shape[o]
        while pi != po:
            if pi < po:
                i += 1
                gi.append(i)
                pi *= in_shape[i]
            else:
                o += 1
                go.append(o)
                po *= out_shape[o]
        major_in = next((d for d in gi if in_shape[d] > 1), gi[0])
        major_out = next((d for d in go if out_shape[d] > 1), go[0])
        result[major_out] = major_in
        i, o = i + 1, o + 1
    return result


class Walker:
    """One pass over a jaxpr. ``split[var]`` is an activation's mp-split dim; ``view[var]`` says
    a var is a parameter seen through transposes/reshapes: ``(param index, param dim per dim)``."""

    def __init__(self, param_shapes: list[tuple[int, ...]], n_shards: int):
        self.shapes, self.n = param_shapes, n_shards
        self.decisions: Decisions = {}
        self.indivisible: dict[int, int] = {}  # param index -> the dim it should have split
        self.split: dict[Any, int | None] = {}
        self.view: dict[Any, tuple[int, list[int | None]]] = {}

    def decide(self, index: int, dim: int | None) -> int | None:
        """Record ``dim`` for a param (first use wins); return the dim actually used."""
        if index not in self.decisions:
            ok = dim is not None and self.shapes[index][dim] % self.n == 0
            self.decisions[index] = dim if ok else None
            if dim is not None and not ok:
                self.indivisible[index] = dim
        return self.decisions[index]

    def get(self, var) -> int | None:
        return None if isinstance(var, jex_core.Literal) else self.split.get(var)

    def run(self, jaxpr, in_split, in_view) -> list[int | None]:
        for var, s, v in zip(jaxpr.invars, in_split, in_view):
            self.split[var] = s
            if v is not None:
                self.view[var] = v
        for eqn in jaxpr.eqns:
            self.eqn(eqn)
        return [self.get(v) for v in jaxpr.outvars]

    def eqn(self, eqn) -> None:
        name, ins, outs = eqn.primitive.name, eqn.invars, eqn.outvars
        views = [self.view.get(v) if not isinstance(v, jex_core.Literal) else None for v in ins]
        sub = next((eqn.params[k] for k in ("jaxpr", "call_jaxpr", "fun_jaxpr")
                    if k in eqn.params), None)
        if sub is not None and name not in ("while", "scan", "cond"):
            sub = getattr(sub, "jaxpr", sub)
            out = self.run(sub, [self.get(v) for v in ins], views)
            for var, s in zip(outs, out):
                self.split[var] = s
            return
        if name == "dot_general":
            self.split[outs[0]] = self.dot_general(eqn, views)
            return
        if name == "gather" and views[0] is not None:  # an embedding lookup: split the vocab
            index, dims = views[0]
            table_dim = eqn.params["dimension_numbers"].start_index_map[0]
            self.decide(index, dims[table_dim])
            self.split[outs[0]] = None
            return
        if len(ins) == 1 and views[0] is not None and name in (
                "transpose", "reshape", "convert_element_type", "copy", "squeeze",
                "expand_dims", "broadcast_in_dim", "copy_p"):
            self.view[outs[0]] = (views[0][0], self.map_dims(eqn, views[0][1]))
            return
        split = [self.get(v) for v in ins]
        if len(ins) == 1:
            for out in outs:
                self.split[out] = self.unary(eqn, split[0])
            return
        self.elementwise(eqn, split, views)

    def map_dims(self, eqn, dims: list) -> list:
        """How the dims of the (single) input appear in the output: the output's list of
        whatever ``dims`` held for the input dim it carries."""
        name, (var,), (out,) = eqn.primitive.name, eqn.invars, eqn.outvars
        if name == "transpose":
            return [dims[p] for p in eqn.params["permutation"]]
        if name == "reshape":
            return [None if i is None else dims[i]
                    for i in reshape_dim_map(var.aval.shape, out.aval.shape)]
        if name == "broadcast_in_dim":
            new = [None] * len(out.aval.shape)
            for i, o in enumerate(eqn.params["broadcast_dimensions"]):
                if var.aval.shape[i] == out.aval.shape[o]:
                    new[o] = dims[i]
            return new
        if name == "squeeze":
            return [d for i, d in enumerate(dims) if i not in eqn.params["dimensions"]]
        if name == "expand_dims":
            new = list(dims)
            for d in sorted(eqn.params["dimensions"]):
                new.insert(d, None)
            return new
        return list(dims) if len(var.aval.shape) == len(out.aval.shape) else \
            [None] * len(out.aval.shape)

    def unary(self, eqn, split: int | None) -> int | None:
        if split is None:
            return None
        name, var, out = eqn.primitive.name, eqn.invars[0], eqn.outvars[0]
        if name.startswith(("reduce_", "argmax", "argmin")) and "axes" in eqn.params:
            axes = eqn.params["axes"]
            return None if split in axes else split - sum(a < split for a in axes)
        if name in ("transpose", "reshape", "broadcast_in_dim", "squeeze", "expand_dims"):
            one_hot = [None] * len(var.aval.shape)
            one_hot[split] = split
            carried = self.map_dims(eqn, one_hot)
            return carried.index(split) if split in carried else None
        if name in ("slice", "split"):  # e.g. a fused QKV output cut into Q, K and V
            return split
        same = var.aval.shape == out.aval.shape or (
            len(var.aval.shape) == len(out.aval.shape)
            and var.aval.shape[split] == out.aval.shape[split])
        return split if same and name not in ELEMENTWISE_SKIP else None

    def elementwise(self, eqn, split, views) -> None:
        """n-ary ops: the output is split like an input of its own shape; a parameter combined
        with a split activation (a bias, a scale) is split the same way."""
        out_shape = eqn.outvars[0].aval.shape
        result = next((s for s, v in zip(split, eqn.invars) if s is not None
                       and getattr(v.aval, "shape", None) == out_shape), None)
        if eqn.primitive.name in ELEMENTWISE_SKIP or len(eqn.outvars) != 1:
            result = None
        for view in views:
            if view is not None and result is not None and len(view[1]) == len(out_shape):
                used = self.decide(view[0], view[1][result])
                if used is None:
                    result = None
        for out in eqn.outvars:
            self.split[out] = result

    def dot_general(self, eqn, views) -> int | None:
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        lhs, rhs = eqn.invars
        l_free = [d for d in range(len(lhs.aval.shape)) if d not in lc and d not in lb]
        r_free = [d for d in range(len(rhs.aval.shape)) if d not in rc and d not in rb]

        def out_pos(side: str, dim: int) -> int | None:
            batch, free = (lb, l_free) if side == "lhs" else (rb, r_free)
            if dim in batch:
                return list(batch).index(dim)
            if dim in free:
                return len(lb) + (0 if side == "lhs" else len(l_free)) + free.index(dim)
            return None  # contracted: a partial sum, whole again after the all-reduce

        if (views[0] is None) == (views[1] is None):  # activation x activation (or param x param)
            for side, var in (("lhs", lhs), ("rhs", rhs)):
                if self.get(var) is not None:
                    return out_pos(side, self.get(var))
            return None
        w_side = "lhs" if views[0] is not None else "rhs"
        (index, dims), x = views[0] or views[1], rhs if w_side == "lhs" else lhs
        w_contract, x_contract = (lc, rc) if w_side == "lhs" else (rc, lc)
        w_free = l_free if w_side == "lhs" else r_free
        x_split = self.get(x)
        if index in self.decisions:  # a parameter used again (tied embeddings, ...)
            chosen = self.decisions[index]
            w_dim = dims.index(chosen) if chosen is not None and chosen in dims else None
        elif x_split is not None and x_split in x_contract:  # row-parallel
            w_dim = w_contract[list(x_contract).index(x_split)]
            w_dim = w_dim if self.decide(index, dims[w_dim]) is not None else None
        else:  # column-parallel on the first output dim
            w_dim = next((d for d in w_free if dims[d] is not None), None)
            w_dim = w_dim if w_dim is not None and self.decide(index, dims[w_dim]) is not None \
                else None
            if w_dim is None:
                self.decide(index, None)
        return None if w_dim is None else out_pos(w_side, w_dim)


def dataflow_split_dims(fn, params, n_shards: int) -> tuple[Decisions, dict[int, int]]:
    """``{leaf index: param dim split over mp}`` for the params ``fn(params)`` touches, and
    ``{leaf index: dim}`` for those whose dim does not divide ``n_shards`` (so replicated).

    ``params`` may hold ``jax.ShapeDtypeStruct``; nothing is computed, only traced.
    """
    closed = jax.make_jaxpr(fn)(params)
    leaves = jax.tree.leaves(params)
    walker = Walker([tuple(x.shape) for x in leaves], n_shards)
    invars = closed.jaxpr.invars
    views = [(i, list(range(len(leaves[i].shape)))) for i in range(len(leaves))]
    walker.run(closed.jaxpr, [None] * len(invars), views + [None] * (len(invars) - len(views)))
    return walker.decisions, walker.indivisible

