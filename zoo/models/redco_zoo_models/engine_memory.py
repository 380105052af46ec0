"""How many sequences an engine (``redco_zoo_models.engine``) can hold, and where its cache
lives on a mesh: rows over ``dp``, key/value heads over ``mp``, where they divide (a recurrent
layer's fixed-size state: rows only)."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def traced(model: nnx.Module, fn):
    """The shapes ``fn(model)`` returns, traced, not run: ``model`` real or abstract
    (``nnx.eval_shape``)."""
    graphdef, state = nnx.split(model)
    return jax.eval_shape(lambda s: fn(nnx.merge(graphdef, s)), state)


def on_devices(params: Any, mesh=None) -> Any:
    """``params`` with each host (numpy) leaf put on the devices (replicated over ``mesh``): a
    jitted step given a numpy array copies it to the devices at every call."""
    sharding = None if mesh is None else NamedSharding(mesh, P())
    return jax.tree.map(lambda x: jax.device_put(x, sharding) if isinstance(x, np.ndarray) else x,
                        params)


def vocab_size(model: nnx.Module, max_len: int, cache_dtype) -> int:
    """The width of the model's logits (a decode step traced, not run)."""
    logits = traced(model, lambda m: m.decode(
        jnp.zeros((1, 1), jnp.int32), jnp.ones((1, max_len), bool),
        m.init_cache(1, max_len, cache_dtype), 0))[0]
    return logits.shape[-1]


def rows_that_fit(model: nnx.Module, params: Any, max_len: int, usable_bytes: int,
                  cache_dtype=jnp.float32, mesh=None) -> int:
    """The most sequences of ``max_len`` an ``Engine`` can hold in ``usable_bytes`` of one
    device beside that device's share of ``params`` (as placed): each row's key/value cache (its
    heads split over ``mp`` where they divide), its logits and key mask, the rows split over
    ``dp``. What a decode step computes on the way is not counted: leave headroom for it (the
    planner's ``usable_bytes`` keeps 10%)."""
    cache = jax.eval_shape(lambda: model.init_cache(1, max_len, cache_dtype))
    dp = 1 if mesh is None else mesh.shape.get("dp", 1)
    row = sum(x.size * x.dtype.itemsize / _heads_split(mesh, path, x)
              for path, x in jax.tree_util.tree_leaves_with_path(cache)) \
        + vocab_size(model, max_len, cache_dtype) * 4 + max_len
    held = sum(np.prod(x.sharding.shard_shape(x.shape) if hasattr(x, "sharding") else x.shape)
               * x.dtype.itemsize for x in jax.tree.leaves(params))
    rows = int((usable_bytes - held) // row) * dp
    if rows < 1:
        raise ValueError(f"One device's {usable_bytes / 2 ** 30:.2f} GiB hold its "
                         f"{held / 2 ** 30:.2f} GiB of the params and no sequence of max_len "
                         f"{max_len} ({row / 2 ** 20:.1f} MiB each): lower max_len, or split the "
                         "params over more devices (n_model_shards).")
    return rows


def cache_sharding(mesh, cache):
    """A sharding for each leaf of ``cache``: rows over ``dp`` and an attention layer's
    key/value heads over ``mp``, where they divide (a recurrent layer's state: rows only);
    None without a mesh."""
    if mesh is None:
        return None

    def leaf(path, x):
        spec = [_divides(mesh, "dp", x.shape[0])] + [None] * (x.ndim - 1)
        if _heads_split(mesh, path, x) > 1:
            spec[2] = "mp"
        return NamedSharding(mesh, P(*spec))
    return jax.tree_util.tree_map_with_path(leaf, cache)


def _divides(mesh, axis: str, n: int) -> str | None:
    return axis if axis in mesh.shape and n % mesh.shape[axis] == 0 else None


def _heads_split(mesh, path, x) -> int:
    """Over how many devices a cache leaf's heads are split: ``mp``'s size for an attention
    layer's keys or values (rows, slots, heads, dim) whose heads it divides, else 1."""
    name = getattr(path[-1], "key", None)
    if mesh is None or name not in ("k", "v") or x.ndim != 4 or \
            not _divides(mesh, "mp", x.shape[2]):
        return 1
    return mesh.shape["mp"]


def rows_sharding(mesh, n_rows: int) -> NamedSharding:
    """An engine's per-row arrays (key mask, logits): rows over ``dp`` where they divide."""
    return NamedSharding(mesh, P("dp" if n_rows % mesh.shape.get("dp", 1) == 0 else None))
