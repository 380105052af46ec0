"""LoRA: low-rank adapters on the kernels of any params pytree, and training only them.

A selected kernel ``W`` [in, out] gets two adapters, ``A`` [in, r] and ``B`` [r, out], and the
model computes with ``W + (alpha / r) * A @ B``. ``B`` starts at zero, so training starts at
the base model exactly; ``A`` starts small and random (uniform, +-1/sqrt(in), as PEFT does).
Only ``A`` and ``B`` are trained: ``Trainer(trainable=mask)`` differentiates only the leaves
``mask`` marks, so the frozen base takes no gradient memory and no optimizer state.

Adapters live next to their kernel, named after it: ``.../q_proj/kernel`` gets
``.../q_proj/lora_a`` and ``.../q_proj/lora_b`` (a kernel leaf named ``w`` gets ``w_lora_a``
and ``w_lora_b``). The names are the marker everything else reads: ``trainable_mask`` marks
them, the sharding rules lay them out by their kernel's spec (for ``W`` split ``(a, b)``, ``A``
gets ``(a, None)`` and ``B`` ``(None, b)``: the column- or row-parallel matmul stays local),
and ``merge`` folds them back into plain kernels for export.

A stacked kernel (``redco.layer_stacks``: a scanned model's ``.../0:32/q_proj/kernel``, layers
on a leading axis) gets stacked adapters, ``A`` [L, in, r] and ``B`` [L, r, out], which the
scan slices with their kernel. Each layer's adapters are drawn from the key its unrolled copy
would get (``adapter_keys``: keys go to the per-layer names in the unrolled model's order), so
a scanned model starts, and trains, as the unrolled one does.

``add_lora(params, apply_fn)`` works for any model whose params are nested mappings (dicts,
Flax NNX ``State``): its ``apply_fn`` merges on the fly, which costs a full-size merged kernel,
and its full-size gradient, per adapted layer. Models that compute ``x @ W + (x @ A) @ B *
scale`` in the projection itself (the zoo's, ``redco_zoo_models.lora``) avoid both and give
params of the same names, so masks, rules, checkpoints and ``merge`` are shared.
"""
from __future__ import annotations

import re
from collections.abc import MutableMapping
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from redco.layer_stacks import layer_names, layer_shape, layers_of
from redco.tree_paths import named_leaves, path_str

# Attention and MLP projections of LLaMA/Mistral/Qwen2 (q_proj ... down_proj), T5 (q, k, v, o,
# wi, wi_0, wi_1, wo), BERT/ViT (query, key, value, dense), BART/OPT (out_proj, fc1, fc2).
DEFAULT_TARGETS = (r"(^|/)(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|q|k|v|o|wi|"
                   r"wi_0|wi_1|wo|query|key|value|dense|out_proj|fc1|fc2)/kernel$")
SUFFIXES = ("lora_a", "lora_b")


def adapter_names(kernel_name: str) -> tuple[str, str]:
    """The names of a kernel leaf's two adapters: ``kernel`` -> ``lora_a``, ``lora_b``; ``w`` ->
    ``w_lora_a``, ``w_lora_b``."""
    return SUFFIXES if kernel_name == "kernel" else tuple(f"{kernel_name}_{s}" for s in SUFFIXES)


def kernel_name_of(name: str) -> tuple[str, int] | None:
    """``(kernel leaf name, 0 for A / 1 for B)`` when ``name`` names an adapter, else None."""
    for which, suffix in enumerate(SUFFIXES):
        if name == suffix:
            return "kernel", which
        if name.endswith("_" + suffix):
            return name[:-len(suffix) - 1], which
    return None


def kernel_paths(params: Any, targets: str = DEFAULT_TARGETS) -> list[str]:
    """The ``/``-joined paths of the 2-D leaves (per layer: a stacked one's slice) ``targets``
    (a regex, ``re.search``) selects."""
    pattern = re.compile(targets)
    return [p for p, leaf in named_leaves(params)
            if len(layer_shape(p, np.shape(leaf))) == 2 and pattern.search(p)
            and kernel_name_of(p.rsplit("/", 1)[-1]) is None]


def is_adapter_path(path: str) -> bool:
    return kernel_name_of(path.rsplit("/", 1)[-1]) is not None


def trainable_mask(params: Any) -> Any:
    """A pytree of bools like ``params``: True on LoRA adapters, False on everything else.
    ``Trainer(trainable=...)`` takes it."""
    return jax.tree_util.tree_map_with_path(lambda p, _: is_adapter_path(path_str(p)), params)


def without_adapters(params: Any) -> Any:
    """``params`` with every LoRA adapter zeroed: the base model they adapt (the reference of
    DPO and GRPO). Made inside a jitted function, it is never stored: no second copy."""
    return jax.tree.map(lambda x, a: jnp.zeros_like(x) if a else x, params,
                        trainable_mask(params))


def n_params(params: Any, mask: Any = None) -> int:
    """The number of parameters (of those ``mask`` marks, when given)."""
    sizes = jax.tree.map(lambda x: int(np.prod(np.shape(x))), params)
    if mask is not None:
        sizes = jax.tree.map(lambda n, m: n if m else 0, sizes, mask)
    return sum(jax.tree.leaves(sizes))


def check_rank(path: str, shape, rank: int) -> None:
    """Refuse a ``rank`` that does not fit the kernel ``shape`` at ``path``, naming the range."""
    if not isinstance(rank, int) or rank < 1 or rank > min(shape):
        raise ValueError(f"LoRA rank {rank!r} does not fit {path} {tuple(shape)}: use an integer "
                         f"from 1 to {min(shape)} (the kernel's smaller dim).")


def select(params: Any, targets: str, rank: int) -> list[str]:
    """``kernel_paths``, or an error listing a few 2-D paths when ``targets`` selects none;
    ``rank`` must fit every selected kernel."""
    try:
        re.compile(targets)
    except re.error as e:
        raise ValueError(f"LoRA targets {targets!r} is not a regex: {e}.") from None
    leaves = dict(named_leaves(params))
    chosen = kernel_paths(params, targets)
    if not chosen:
        matrices = [p for p, x in leaves.items() if np.ndim(x) == 2][:6]
        raise ValueError(f"LoRA targets {targets!r} select no 2-D kernel. Kernel paths look "
                         f"like: {matrices}; give a regex that matches some of them.")
    for path in chosen:
        check_rank(path, layer_shape(path, np.shape(leaves[path])), rank)
    return chosen


def unrolled_order(name: str) -> tuple:
    """Sort key of a per-layer path as a model's modules are walked: by component, layer
    indices as numbers (``.../2/...`` before ``.../10/...``)."""
    return tuple((0, int(c), "") if c.isdigit() else (1, 0, c) for c in name.split("/"))


def adapter_keys(kernels: list[str], seed: int) -> dict[str, jax.Array]:
    """A PRNG key per kernel path, a stacked kernel's (L, 2): one per layer. ``seed``'s keys go
    to the per-layer names in the unrolled model's order (``unrolled_order``), so a layer's
    adapters start the same stacked or not."""
    per_layer = {k: layer_names(k) if layers_of(k) is not None else [k] for k in kernels}
    names = sorted((n for ns in per_layer.values() for n in ns), key=unrolled_order)
    keys = dict(zip(names, jax.random.split(jax.random.PRNGKey(seed), max(len(names), 1))))
    return {k: keys[ns[0]] if layers_of(k) is None else jnp.stack([keys[n] for n in ns])
            for k, ns in per_layer.items()}


def init_adapters(key: jax.Array, kernel_shape, rank: int, dtype) -> tuple[jax.Array, jax.Array]:
    """``A`` [in, r] uniform in +-1/sqrt(in) (PEFT's Kaiming init) and ``B`` [r, out] zeros; for
    a stacked kernel [L, in, out], ``key`` holds one key per layer (``adapter_keys``) and each
    layer's pair is drawn as its unrolled copy's: ``A`` [L, in, r], ``B`` [L, r, out]."""
    if len(kernel_shape) == 3:
        return jax.vmap(lambda k: init_adapters(k, kernel_shape[1:], rank, dtype))(key)
    fan_in, fan_out = kernel_shape
    bound = 1.0 / np.sqrt(fan_in)
    a = jax.random.uniform(key, (fan_in, rank), jnp.float32, -bound, bound).astype(dtype)
    return a, jnp.zeros((rank, fan_out), dtype)


def _copy(tree: Any) -> Any:
    """New containers, the same leaves (mappings can then gain and lose keys)."""
    return jax.tree.map(lambda x: x, tree)


def _parent(tree: Any, path) -> tuple[MutableMapping, Any]:
    """The mapping holding the leaf at ``path`` (a key path) and its key there."""
    keys = [getattr(k, "key", getattr(k, "idx", getattr(k, "name", None))) for k in path]
    if keys and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
        keys = keys[:-1]  # a Flax NNX Variable's value
    node = tree
    for key in keys[:-1]:
        node = node[key]
    if not isinstance(node, MutableMapping):
        raise TypeError(f"LoRA adds adapters next to kernels in nested dicts or Flax NNX State; "
                        f"{'/'.join(map(str, keys))} sits in a {type(node).__name__}.")
    return node, keys[-1]


def _value(x: Any) -> Any:
    """The array a leaf holds (a Flax NNX Variable's value, or the leaf itself)."""
    return x.get_value() if hasattr(x, "get_value") else x


def _like(container: Any, value: jax.Array) -> Any:
    """``value`` held as ``container`` holds its kernel (an NNX ``Param``, or bare)."""
    try:
        from flax import nnx
        if isinstance(container, nnx.Variable):
            return type(container)(value)
    except ImportError:  # pragma: no cover - flax comes with redco
        pass
    return value


def add_adapters(params: Any, rank: int = 8, targets: str = DEFAULT_TARGETS, seed: int = 0) -> Any:
    """``params`` with ``A`` and ``B`` next to every kernel ``targets`` selects (a copy: the
    given tree is left as it was)."""
    import flax.core
    if isinstance(params, flax.core.FrozenDict):
        params = flax.core.unfreeze(params)
    chosen = set(select(params, targets, rank))
    out = _copy(params)
    found = [(p, leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
             if path_str(p) in chosen]
    keys = adapter_keys([path_str(p) for p, _ in found], seed)
    for path, leaf in found:
        parent, name = _parent(out, path)
        a, b = init_adapters(keys[path_str(path)], np.shape(leaf), rank, leaf.dtype)
        for adapter, value in zip(adapter_names(str(name)), (a, b)):
            if adapter in parent:
                raise ValueError(f"{path_str(path)} already has an adapter {adapter}.")
            parent[adapter] = _like(parent[name], value)
    return out


def merge(params: Any, alpha: float) -> Any:
    """Every adapted kernel ``W`` replaced by ``W + (alpha / r) * A @ B`` and the adapters
    dropped: the base model's params, for export or a model without adapters. Traceable."""
    out = _copy(params)
    pairs: dict[tuple, dict] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        parent_path, name = path_str(path).rpartition("/")[::2]
        found = kernel_name_of(name)
        if found is not None:
            pairs.setdefault((parent_path, found[0]), {})[found[1]] = path
    for (_, kernel), adapters in pairs.items():
        parent, name_a = _parent(out, adapters[0])
        name_b = _parent(out, adapters[1])[1]
        a, b, w = (_value(parent[name]) for name in (name_a, name_b, kernel))
        merged = w + ((alpha / a.shape[-1]) * (a @ b)).astype(w.dtype)
        parent[kernel] = _like(parent[kernel], merged)
        del parent[name_a], parent[name_b]
    return out


def partition(params: Any, mask: Any) -> tuple[Any, Any]:
    """``(trainable, frozen)``: ``params`` with the leaves ``mask`` leaves out set to None, and
    the other way round. ``combine`` joins them again."""
    def keep(flag):
        return lambda x, m: x if bool(m) == flag else None
    return jax.tree.map(keep(True), params, mask), jax.tree.map(keep(False), params, mask)


def combine(trainable: Any, frozen: Any) -> Any:
    """The params again from ``partition``'s two halves."""
    return jax.tree.map(lambda t, f: f if t is None else t, trainable, frozen,
                        is_leaf=lambda x: x is None)


class LoRA(NamedTuple):
    """What ``add_lora`` gives: the params with adapters, an ``apply_fn`` taking them, the
    optimizer unchanged, the ``trainable`` mask for ``Trainer(trainable=...)``, and ``alpha``
    for ``merge``."""
    params: Any
    apply_fn: Callable
    optimizer: Any
    trainable: Any
    alpha: float

    def merge(self, params: Any = None) -> Any:
        """The trained params (by default the starting ones) with the adapters merged in."""
        return merge(self.params if params is None else params, self.alpha)


def add_lora(params: Any, apply_fn: Callable, optimizer: Any = None, *, rank: int = 8,
             alpha: float = 16.0, targets: str = DEFAULT_TARGETS, seed: int = 0) -> LoRA:
    """LoRA for any model: adapters on the kernels ``targets`` selects, an ``apply_fn`` that
    merges them on the fly (``apply_fn(merge(params), ...)``), and the trainable mask. A
    function of what ``Trainer`` takes, so the run (or a layout planner) can switch it on::

        lora = add_lora(params, apply_fn, optimizer, rank=8)
        Trainer(deployer, collate_fn, lora.apply_fn, loss_fn, lora.params, lora.optimizer,
                trainable=lora.trainable)
    """
    with_adapters = add_adapters(params, rank, targets, seed)

    def lora_apply_fn(params, *args, **kwargs):
        return apply_fn(merge(params, alpha), *args, **kwargs)
    return LoRA(with_adapters, lora_apply_fn, optimizer, trainable_mask(with_adapters), alpha)


def follow_kernels(specs: dict[str, Any], shapes: dict[str, tuple]) -> dict[str, Any]:
    """Adapter specs from their kernels' (``{path: PartitionSpec}``): for ``W`` [in, out]
    ``(a, b)``, ``A`` [in, r] gets ``(a, None)`` and ``B`` [r, out] ``(None, b)``; a stacked
    kernel's ``(None, a, b)`` gives ``(None, a, None)`` and ``(None, None, b)``."""
    from jax.sharding import PartitionSpec as P
    out = dict(specs)
    for path in specs:
        parent, _, name = path.rpartition("/")
        found = kernel_name_of(name)
        if found is None:
            continue
        kernel = f"{parent}/{found[0]}" if parent else found[0]
        if kernel not in specs or len(layer_shape(kernel, shapes.get(kernel, ()))) != 2:
            continue
        lead = (None,) if layers_of(kernel) is not None else ()
        entries = list(specs[kernel])[len(lead):] + [None, None]
        a, b = entries[0], entries[1]
        spec = (*lead, a, None) if found[1] == 0 else (*lead, None, b)
        out[path] = P(*spec) if any(e is not None for e in spec) else P()
    return out
