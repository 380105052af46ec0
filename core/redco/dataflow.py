"""The paper's two rules, read off the model's real dataflow instead of its parameter names.

Trace the model to a jaxpr and walk it, tracking for every activation which of its dims (if
any) is split over ``mp``. At each matmul with a parameter:

* the activation's split dim is contracted -> the parameter is **row**-parallel (split on the
  matching input dim) and the output is whole again after XLA's all-reduce;
* the activation is whole -> **column**-parallel (split on its first output dim), so the output
  is split;
* the activation is split on a dim the matmul keeps (heads as a batch dim, ...) -> the
  parameter follows it on a batch dim, or stays whole.

Attention follows: Q, K, V see whole activations (column); the head dim stays split through
the reshapes and the score/value matmuls; O contracts over it (row). Feed-forward pairs, fused
QKV kernels, transposed kernels (GPT-2's ``Conv1D``) and ``Dense_10`` after ``Dense_9`` all come
out right because only the computation counts (a fused kernel laid out ``[Q|K|V]``, as GPT-2's
``c_attn``, is split contiguously: no spec of it gives every shard its own heads of all three,
so XLA moves the misplaced parts with collective-permutes). A bias or scale combined with a
split activation is split the same way.

Lookup tables (a ``gather`` from a parameter): the token embeddings (the tables a matmul also
uses, i.e. tied LM heads; else the tables with the most rows) split their rows, the vocabulary.
Values read from a smaller table that meet a split activation split that table to match (T5's
relative attention bias, added to scores split by heads, splits on heads); other small tables
(positions, token types) stay replicated. Everything else is replicated.

A column split that would have to be gathered again downstream is worth nothing: its kernel is
replicated instead and the walk repeated (BERT's MLM transform, whose output the tied decoder,
split on the vocabulary, needs whole; Q, K, V of 3 heads on 2 shards). A replicated column
kernel (forced so, or its output dim does not divide) takes its row partner along: the
activation between them is whole, so that kernel is replicated too.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
from jax.extend import core as jex_core

from redco.lora import is_adapter_path
from redco.tree_paths import path_str

Decisions = dict[int, int | None]  # param index -> param dim split over mp (None: replicate)
ELEMENTWISE_SKIP = {"gather", "scatter", "scatter-add", "dynamic_slice", "dynamic_update_slice",
                    "iota", "rng_bit_generator", "sort", "argsort", "cumsum", "while", "cond"}
LAYOUT = {"transpose", "reshape", "convert_element_type", "copy", "copy_p", "squeeze",
          "expand_dims", "broadcast_in_dim", "stop_gradient"}


class Info(NamedTuple):
    """What the walk knows about one var. ``view``: the var *is* a parameter, re-laid out;
    ``lookup``: it holds values read from a parameter's rows. Both are ``(param index, param
    dim per var dim)``. ``origin``: the column-parallel kernel that split it; ``phantom``: that
    kernel is replicated after all, so the var is whole but its row partner is replicated too.
    ``derived``: computed from parameters alone (LoRA's ``A @ B``); a parameter plus such a term
    is still that parameter (``W + s * A @ B`` is laid out, and decided, as ``W``). ``normed``:
    a statistic reduced over the dim a phantom of that origin is split on (a norm's mean or
    variance); the phantom combined with it is a residual stream, whole from then on.
    """
    split: int | None = None
    origin: int | None = None
    view: tuple[int, list] | None = None
    lookup: tuple[int, list] | None = None
    phantom: bool = False
    derived: bool = False
    normed: int | None = None


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


def shift(info: Info, by: int) -> Info:
    """``info`` for a var with its leading dim taken away (``by=-1``, a scan's slice) or put in
    front (``by=+1``, a scan's stacked outputs)."""
    def dims(held):
        index, per_dim = held
        return index, per_dim[1:] if by < 0 else [None, *per_dim]
    split = info.split
    if split is not None:
        split = split + by if split + by >= 0 else None
    return info._replace(split=split, origin=info.origin if split is not None else None,
                         view=info.view and dims(info.view),
                         lookup=info.lookup and dims(info.lookup))


class Walker:
    """One pass over a jaxpr. ``forced``: kernels to replicate (their split was worthless);
    ``vocab``: lookup tables to split on the dim a lookup indexes."""

    def __init__(self, param_shapes: list[tuple[int, ...]], n_shards: int, forced=frozenset(),
                 vocab=frozenset(), adapters=frozenset()):
        self.shapes, self.n, self.forced, self.vocab = param_shapes, n_shards, forced, vocab
        self.adapters = adapters  # LoRA factors: laid out by their kernel (redco.lora)
        self.decisions: Decisions = {}
        self.indivisible: dict[int, int] = {}  # param index -> the dim it should have split
        self.tables: dict[int, int] = {}  # param index -> its dim a lookup indexes
        self.weights: set[int] = set()  # params a matmul uses (a table among them: tied)
        self.conflicts: set[int] = set()  # origins of splits that must be gathered again
        self.uneven: dict[int, int] = {}  # of those, the ones cut unevenly into heads
        self.info: dict[Any, Info] = {}

    def decide(self, index: int, dim: int | None) -> int | None:
        """Record ``dim`` for a param (first use wins); return the dim actually used."""
        if index not in self.decisions:
            ok = dim is not None and index not in self.forced and self.shapes[index][dim] % \
                self.n == 0
            self.decisions[index] = dim if ok else None
            if dim is not None and index not in self.forced and not ok:
                self.indivisible[index] = dim
        return self.decisions[index]

    def replicate(self, index: int, dim: int | None) -> None:
        """Replicate a param that goes with a replicated kernel; name it if ``dim`` (the one
        it would have split) does not divide either."""
        if index not in self.decisions and dim is not None and self.shapes[index][dim] % self.n:
            self.indivisible[index] = dim
        self.decide(index, None)

    def conflict(self, info: Info) -> None:
        if info.origin is not None:
            self.conflicts.add(info.origin)

    def get(self, var) -> Info:
        return Info() if isinstance(var, jex_core.Literal) else self.info.get(var, Info())

    def run(self, jaxpr, in_info: list[Info]) -> list[Info]:
        self.info.update(zip(jaxpr.invars, in_info))
        for eqn in jaxpr.eqns:
            self.eqn(eqn)
        return [self.get(v) for v in jaxpr.outvars]

    def eqn(self, eqn) -> None:
        name, ins, outs = eqn.primitive.name, eqn.invars, eqn.outvars
        info = [self.get(v) for v in ins]
        sub = next((eqn.params[k] for k in ("jaxpr", "call_jaxpr", "fun_jaxpr")
                    if k in eqn.params), None)
        if name == "scan":
            self.info.update(zip(outs, self.scan(eqn, info)))
        elif sub is not None and name not in ("while", "cond"):
            self.info.update(zip(outs, self.run(getattr(sub, "jaxpr", sub), info)))
        elif name == "dot_general":
            self.info[outs[0]] = self.dot_general(eqn, info)
        elif name == "gather" and info[0].view is not None:
            self.info[outs[0]] = self.gather(eqn, info[0].view)
        elif len(ins) == 1 and name in LAYOUT and (info[0].view or info[0].lookup):
            index, dims = info[0].view or info[0].lookup
            kind = "view" if info[0].view else "lookup"
            self.info[outs[0]] = Info(**{kind: (index, self.map_dims(eqn, dims))})
        elif len(ins) == 1:
            for out in outs:
                self.info[out] = self.unary(eqn, info[0])
        else:
            self.elementwise(eqn, info)

    def scan(self, eqn, info: list[Info]) -> list[Info]:
        """A ``lax.scan``'s body (tiled attention over key blocks, scanned layers), walked once
        with the consts, the carries and one slice of each scanned input (its dim 0 gone); what
        it stacks gets that dim back. A carry started whole that the body adds split values to
        (an accumulator of per-head results) comes out split, as it is after the first step."""
        params = eqn.params
        n_consts, n_carry = params["num_consts"], params["num_carry"]
        sliced = [shift(i, -1) for i in info[n_consts + n_carry:]]
        out = self.run(params["jaxpr"].jaxpr, info[:n_consts + n_carry] + sliced)
        return out[:n_carry] + [shift(i, +1) for i in out[n_carry:]]

    def gather(self, eqn, view) -> Info:
        """A lookup: which table dim is indexed, and where the table's other dims land."""
        index, dims = view
        dn, operand = eqn.params["dimension_numbers"], eqn.invars[0].aval.shape
        if len(dn.start_index_map) != 1 or dims[dn.start_index_map[0]] is None:
            return Info()
        self.tables.setdefault(index, dims[dn.start_index_map[0]])
        if index in self.vocab:
            self.decide(index, self.tables[index])
        kept = [d for d in range(len(operand))
                if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
        out = [None] * len(eqn.outvars[0].aval.shape)
        for pos, d in zip(dn.offset_dims, kept):
            if eqn.params["slice_sizes"][d] == operand[d]:
                out[pos] = dims[d]
        return Info(lookup=(index, out))

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

    def unary(self, eqn, info: Info) -> Info:
        if info.derived:
            return Info(derived=True)
        split = info.split
        if split is None:
            return Info(normed=info.normed)
        name, var, out = eqn.primitive.name, eqn.invars[0], eqn.outvars[0]
        if name.startswith(("reduce_", "argmax", "argmin")) and "axes" in eqn.params:
            axes = eqn.params["axes"]  # over the split dim: a cheap all-reduce of the result
            if split in axes and info.phantom:
                return Info(normed=info.origin)  # (a norm's statistic, see ``elementwise``)
            split = None if split in axes else split - sum(a < split for a in axes)
        elif name in ("transpose", "reshape", "broadcast_in_dim", "squeeze", "expand_dims"):
            one_hot = [None] * len(var.aval.shape)
            one_hot[split] = split
            carried = self.map_dims(eqn, one_hot)
            size, split = var.aval.shape[split], carried.index(split) if split in carried \
                else None
            uneven = split is not None and name == "reshape" and \
                not self.cut_evenly(size, out.aval.shape[split:])
            if uneven and self.wide(info.origin):
                pass  # heads that do not divide (72 on 64 shards): split within heads anyway;
                # replicating Q, K, V, O would cost far more memory than the resharding
            elif not info.phantom and (split is None or uneven):
                # merged as a minor dim, or a narrow projection (GQA's K, V) cut unevenly
                self.conflict(info)
                if split is not None and info.origin is not None:
                    self.uneven[info.origin] = self.decisions[info.origin]
                split = None
        elif name not in ("slice", "split"):  # slices: e.g. a fused QKV output cut in three
            same = len(var.aval.shape) == len(out.aval.shape) and \
                var.aval.shape[split] == out.aval.shape[split]
            split = split if same and name not in ELEMENTWISE_SKIP else None
        return Info(split, info.origin, phantom=info.phantom) if split is not None else Info()

    def wide(self, origin: int | None) -> bool:
        """Whether the kernel that split an activation is split on its widest dim (Q: d -> d),
        not a narrow projection (GQA's K, V: d -> kv_heads * head_dim)."""
        if origin is None or self.decisions.get(origin) is None:
            return False
        shape = self.shapes[origin]
        return shape[self.decisions[origin]] >= max(shape)

    def cut_evenly(self, size: int, out_shape) -> bool:
        """Whether a split dim of ``size``, reshaped into the leading dims of ``out_shape``,
        is still cut into whole heads: heads, or (KV head, group) pairs of grouped queries; not
        3 heads on 2 shards, and not halves of ``head_dim`` (2 KV heads on 4 shards: K and V
        are then replicated, as Megatron does, rather than resharded around RoPE)."""
        sizes, n = [], self.n
        while math.prod(sizes) < size:
            sizes.append(out_shape[len(sizes)])
        for i, dim in enumerate(sizes):
            if n <= dim:
                into_head_dim = 0 < i == len(sizes) - 1 == len(out_shape) - 1
                return dim % n == 0 and not into_head_dim
            if n % dim:
                return False
            n //= dim
        return n == 1

    def elementwise(self, eqn, info: list[Info]) -> None:
        """n-ary ops: the output is split like an input split on a dim the output keeps; a
        parameter (or values read from one) combined with it is split the same way."""
        out_shape = eqn.outvars[0].aval.shape
        if eqn.primitive.name in ELEMENTWISE_SKIP or len(eqn.outvars) != 1:
            self.info.update((out, Info()) for out in eqn.outvars)
            return
        fits = lambda var, i: i.split is not None and len(getattr(var.aval, "shape", ())) == \
            len(out_shape) and var.aval.shape[i.split] == out_shape[i.split]
        splits = sorted((i for var, i in zip(eqn.invars, info) if fits(var, i)),
                        key=lambda i: i.phantom)  # a real split wins over a phantom one
        if not splits and any(i.derived for i in info):
            self.info[eqn.outvars[0]] = self.with_derived(eqn.invars, info, len(out_shape))
            return
        normed = {i.normed for i in info} - {None}
        if not splits:  # values read from one table, e.g. plus a mask, are still its values
            lookups = [i.lookup for i in info if i.view or i.lookup]
            one = len(lookups) == 1 and lookups[0] and len(lookups[0][1]) == len(out_shape)
            self.info[eqn.outvars[0]] = Info(lookup=lookups[0]) if one else \
                Info(normed=min(normed, default=None))
            return
        split = splits[0]
        if split.phantom and split.origin in normed:
            # a phantom normalised over its split dim: not the middle of a column/row pair but
            # a residual stream (a vision tower's after a patch-embedding matmul that is
            # replicated), so the next kernel starts a pair of its own instead of following
            self.info[eqn.outvars[0]] = Info()
            return
        for i in info:
            param = i.view or i.lookup
            if i in splits and not i.phantom and i.split != split.split:
                self.conflict(i)
            elif param is not None and len(param[1]) == len(out_shape) and \
                    param[1][split.split] is not None:
                (self.replicate if split.phantom else self.decide)(param[0], param[1][split.split])
        self.info[eqn.outvars[0]] = split

    def with_derived(self, invars, info: list[Info], ndim: int) -> Info:
        """Parameters and terms derived from parameters only: one parameter (``W + s * A @ B``)
        stays a view of it; derived terms alone stay derived; anything else is whole."""
        given = [(v, i) for v, i in zip(invars, info) if not isinstance(v, jex_core.Literal)]
        views = [i.view for _, i in given if i.view is not None]
        if all(i.view is not None or i.derived for _, i in given):
            if not views:
                return Info(derived=True)
            if len(views) == 1 and len(views[0][1]) == ndim:
                return Info(view=views[0])
        return Info()

    def dot_general(self, eqn, info: list[Info]) -> Info:
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

        if all(i.view is not None or i.derived for i in info):  # parameters alone: A @ B
            return Info(derived=True)
        if (info[0].view is None) == (info[1].view is None):  # activation x activation
            outs = sorted(((out_pos(side, i.split), i) for side, i in (("lhs", info[0]),
                                                                        ("rhs", info[1]))
                           if i.split is not None), key=lambda o: o[1].phantom)
            if len(outs) == 2 and outs[0][0] != outs[1][0] and not outs[1][1].phantom:
                self.conflict(outs[1][1])
            return next((i._replace(split=pos) for pos, i in outs if pos is not None), Info())
        w_side = "lhs" if info[0].view is not None else "rhs"
        (index, dims), x = (info[0] if w_side == "lhs" else info[1]).view, \
            info[1] if w_side == "lhs" else info[0]
        if index in self.adapters:  # x @ A or (x @ A) @ B beside x @ W: decides nothing
            x_contract = rc if w_side == "lhs" else lc
            kept = x.split is not None and not x.phantom and x.split not in x_contract
            return x._replace(split=out_pos("rhs" if w_side == "lhs" else "lhs", x.split)) \
                if kept else Info()
        self.weights.add(index)
        w_contract, x_contract = (lc, rc) if w_side == "lhs" else (rc, lc)
        w_batch, x_batch = (lb, rb) if w_side == "lhs" else (rb, lb)
        w_free = l_free if w_side == "lhs" else r_free
        x_side = "rhs" if w_side == "lhs" else "lhs"
        if x.phantom and x.split in x_contract and index not in self.decisions:
            self.replicate(index, dims[w_contract[list(x_contract).index(x.split)]])
            return Info()  # the partner of a replicated column kernel
        if x.split is not None and not x.phantom:
            if x.split in x_contract or x.split in x_batch:  # row-parallel (or per-head)
                match = w_contract[list(x_contract).index(x.split)] if x.split in x_contract \
                    else w_batch[list(x_batch).index(x.split)]
                if dims[match] is None or self.decide(index, dims[match]) != dims[match]:
                    self.conflict(x)  # the weight is not split to match: x is gathered
            else:  # split on a dim the output keeps: the weight stays whole
                self.decide(index, None)
            pos = out_pos(x_side, x.split)
            return Info() if pos is None else x._replace(split=pos)
        if index in self.decisions:  # a parameter used again (tied embeddings, ...)
            chosen = self.decisions[index]
            pos = out_pos(w_side, dims.index(chosen)) if chosen in dims else None
            return Info() if pos is None else Info(pos, index)
        w_dim = next((d for d in w_free if dims[d] is not None), None)  # column-parallel on
        if w_dim is None:  # the first output dim
            self.decide(index, None)
            return Info()
        phantom = self.decide(index, dims[w_dim]) is None  # replicated: so is its partner
        return Info(out_pos(w_side, w_dim), index, phantom=phantom)


class DataflowError(RuntimeError):
    """The dataflow walker could not follow a model's jaxpr (the model itself traced fine)."""


def walk(walker: Walker, jaxpr, in_info: list[Info]) -> None:
    """``walker.run(jaxpr, in_info)``; any failure of it becomes a ``DataflowError`` saying how
    to shard without the walker. The walk reads jaxprs, whose primitives and params JAX changes
    between versions, so the error names the version."""
    try:
        walker.run(jaxpr, in_info)
    except Exception as error:  # re-raised: whatever the walk tripped on, say what to do
        raise DataflowError(
            f"redco's dataflow walker (redco/dataflow.py) could not follow this model's jaxpr on "
            f"jax {jax.__version__} ({type(error).__name__}: {error}). Shard by parameter names "
            "instead, Deployer(sharding_rules='auto-names'), or give your own rules, "
            "Deployer(sharding_rules=[(regex, PartitionSpec), ...]); and please report it, with "
            "your jax version.") from error


def dataflow_split_dims(fn, params, n_shards: int) -> tuple[Decisions, dict[int, int]]:
    """``{leaf index: param dim split over mp}`` for the params ``fn(params)`` touches, and
    ``{leaf index: dim}`` for those replicated because that dim, or the heads it is cut into,
    does not divide ``n_shards``.

    ``params`` may hold ``jax.ShapeDtypeStruct``; nothing is computed, only traced.
    """
    closed = jax.make_jaxpr(fn)(params)
    paths, leaves = zip(*jax.tree_util.tree_flatten_with_path(params)[0]) if \
        jax.tree.leaves(params) else ((), ())
    adapters = frozenset(i for i, p in enumerate(paths) if is_adapter_path(path_str(p)))
    shapes = [tuple(x.shape) for x in leaves]
    in_info = [Info(view=(i, list(range(len(s))))) for i, s in enumerate(shapes)]
    in_info += [Info()] * (len(closed.jaxpr.invars) - len(leaves))
    forced: set[int] = set()
    vocab: set[int] = set()
    uneven: dict[int, int] = {}
    while True:  # once to find the lookup tables, then once more per worthless column split
        walker = Walker(shapes, n_shards, frozenset(forced), frozenset(vocab), adapters)
        walk(walker, closed.jaxpr, in_info)
        uneven.update(walker.uneven)
        rows = {i: shapes[i][d] for i, d in walker.tables.items()}
        tied = set(rows) & walker.weights
        largest = tied or {i for i, r in rows.items() if r == max(rows.values())}
        if walker.conflicts <= forced and largest == vocab:
            return walker.decisions, {**walker.indivisible, **uneven}
        forced, vocab = forced | walker.conflicts, largest
