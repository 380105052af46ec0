"""The layout a model decodes on, and moving its params there and back.

A decode step reads every weight once for a few rows of one token each. Under FSDP (weights split
over ``dp``) every step all-gathers every weight again: the whole model crosses the links per
token. Under tensor parallelism (weights split over ``mp``) the weights stay where they are and
only activations move: an all-reduce of rows x width after each row-split matmul and the logits
gathered over the vocabulary, bytes that grow with the rows decoded, not with the model.
Devices that hold whole copies (replicas) each decode their own rows and exchange nothing.

The rule (``choose_decode_layout``): no weight is split over ``dp``; the tensor-parallel degree
``mp`` is the smallest of 1, 2, 4, ... (then the other divisors of the device count) whose
decode step fits ``1 - headroom`` of one device's memory, and the remaining devices are
replicas over ``dp``, the engine's rows split among them. The smallest, because the all-reduces
grow with the degree and the replicas, which run in parallel for free, shrink. "Fits" is
measured, not estimated, as the layout planner measures a train step: the engine's own decode
step (``engine_steps.decode_rows``) compiled ahead of time on abstract shapes, its params, key/value
cache and logits sharded as the engine places them, read off XLA's ``memory_analysis()``
(arguments + outputs - donated aliases + temporaries); ``compile_prefill`` compiles the
engine's prefill the same way (GRPO's rollout split, ``redco_zoo_grpo.rollout_split``, reads
both programs' costs). Without a memory budget (CPU devices
report none) the first degree is taken, uncompiled. The weights split over ``mp`` as the
``auto`` rule set splits them from parameter names (``redco.builtins.rules``); the cache's
key/value heads too, where they divide (``engine_memory.cache_sharding``).

``to_layout`` moves params onto a layout leaf by leaf, freeing each source leaf once its copy
has landed: the model is never held twice (one leaf at most, in flight), at the price of one
reshard each way (GRPO's rollouts: ``redco_zoo_grpo.engine_rollouts``). A leaf already laid out
so is kept as it is, shared.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from redco import plugins
from redco.hlo_collectives import collectives
from redco.sharding import make_mesh, shardings_from_specs, specs_from_rules
from redco_zoo_models.engine_memory import cache_sharding, rows_sharding, traced, vocab_size
from redco_zoo_models.engine_steps import decode_rows, prefill_rows, slotted_leaves

HEADROOM = 0.1  # of a device's memory kept free, as the layout planner keeps it


@dataclass
class DecodeLayout:
    """``n_model_shards`` devices split each weight (``mesh``: ``('dp', 'mp')``, ``dp`` the
    replicas); ``shardings`` places the params; ``peak_bytes`` the decode step's per-device peak
    (None: not compiled); ``tried`` each degree measured and its peak (None: its weights alone
    were over the budget)."""
    n_model_shards: int
    mesh: Mesh
    shardings: Any
    peak_bytes: int | None = None
    tried: dict[int, int | None] = field(default_factory=dict)

    def describe(self) -> str:
        peak = "not measured (no memory budget)" if self.peak_bytes is None else \
            f"decode step peak {self.peak_bytes / 2 ** 20:.1f} MiB per device"
        return (f"decode layout: tensor parallel over {self.n_model_shards}, "
                f"{self.mesh.shape['dp']} replicas ({peak})")


def _shaped(x, sharding):
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)


def model_shard_degrees(n_devices: int) -> list[int]:
    """The degrees tried, in order: 1, 2, 4, ... then any other divisor of ``n_devices``."""
    divisors = [d for d in range(1, n_devices + 1) if n_devices % d == 0]
    return sorted(divisors, key=lambda d: (d & (d - 1) != 0, d))


def decode_shardings(params: Any, mesh: Mesh) -> Any:
    """Shardings of ``params`` on ``mesh``: the ``auto`` rule set's split over ``mp`` (from
    parameter names), nothing over ``dp``; what does not divide is replicated."""
    rules = plugins.lookup("sharding_rules", "auto")(params, mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # indivisible params replicate, as in training
        return shardings_from_specs(specs_from_rules(params, rules, mesh), mesh)


def held_bytes(params: Any, shardings: Any) -> int:
    """The bytes of ``params`` one device holds under ``shardings``."""
    return sum(math.prod(s.shard_shape(np.shape(x))) * np.dtype(x.dtype).itemsize
               for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(shardings)))


def compile_prefill(model: nnx.Module, params, mesh, shardings, rows: int, prompts: int,
                    width: int, max_len: int, cache_dtype=jnp.float32):
    """The engine's prefill of ``prompts`` prompts ``width`` wide into an engine of ``rows``
    rows of ``max_len``, compiled ahead of time on abstract shapes placed as ``Engine``
    places them."""
    everywhere = NamedSharding(mesh, P())
    cache = traced(model, lambda m: m.init_cache(rows, max_len, cache_dtype))
    vocab = vocab_size(model, max_len, cache_dtype)
    on_rows = rows_sharding(mesh, rows)
    args = (jax.tree.map(_shaped, params, shardings),
            jax.tree.map(_shaped, cache, cache_sharding(mesh, cache)),
            jax.ShapeDtypeStruct((rows, max_len), bool, sharding=on_rows),
            jax.ShapeDtypeStruct((rows, vocab), jnp.float32, sharding=on_rows),
            *[jax.ShapeDtypeStruct(s, jnp.int32, sharding=everywhere) for s in (
                (prompts, width), (prompts,), (prompts,), (prompts,), (4, rows), (2,))])
    slotted = slotted_leaves(model, max_len, cache_dtype)
    step = jax.jit(lambda *a: prefill_rows(nnx.graphdef(model), slotted, *a),
                   donate_argnums=(1, 2, 3))
    return step.lower(*args).compile()


def compile_decode_step(model: nnx.Module, params: Any, mesh: Mesh, shardings: Any,
                        max_seqs: int, max_len: int, cache_dtype=jnp.float32,
                        steps_per_sync: int = 1):
    """The engine's decode step over all ``max_seqs`` rows, compiled ahead of time on abstract
    shapes: ``params`` (real or abstract) placed by ``shardings``, the cache, key mask and
    logits as ``Engine`` places them on ``mesh`` (and donated, as it donates them). Nothing is
    allocated."""
    params = jax.tree.map(_shaped, params, shardings)
    cache = traced(model, lambda m: m.init_cache(max_seqs, max_len, cache_dtype))
    cache = jax.tree.map(_shaped, cache, cache_sharding(mesh, cache))
    rows, everywhere = rows_sharding(mesh, max_seqs), NamedSharding(mesh, P())
    vocab = vocab_size(model, max_len, cache_dtype)
    per_row = [((max_seqs,), jnp.int32), ((max_seqs,), bool), ((3, max_seqs), jnp.float32),
               ((max_seqs, 2), jnp.uint32), ((max_seqs,), jnp.int32)]
    args = (params, cache, jax.ShapeDtypeStruct((max_seqs, max_len), bool, sharding=rows),
            jax.ShapeDtypeStruct((max_seqs, vocab), jnp.float32, sharding=rows),
            *[jax.ShapeDtypeStruct(s, d, sharding=everywhere) for s, d in per_row])
    step = partial(decode_rows, nnx.graphdef(model), steps_per_sync, mesh)
    return jax.jit(step, donate_argnums=(1, 2, 3)).lower(*args).compile()


def peak_bytes(compiled) -> int:
    """A compiled program's per-device peak: arguments + outputs - donated aliases + temps."""
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes)


def collective_bytes(compiled) -> dict[str, int]:
    """Bytes each kind of collective delivers to one device in one run of ``compiled``
    (``redco.hlo_collectives``: each op counted once, a loop's body once)."""
    return {kind: entry["bytes"] for kind, entry in collectives(compiled.as_text()).items()}


def choose_decode_layout(model: nnx.Module, params: Any, devices: Sequence, max_seqs: int,
                         max_len: int,
                         device_memory_bytes: int | None = None, cache_dtype=jnp.float32,
                         steps_per_sync: int = 4, headroom: float = HEADROOM,
                         degrees: Sequence[int] | None = None) -> DecodeLayout:
    """The decode layout over ``devices`` for an engine of ``max_seqs`` rows of ``max_len``
    slots (the module docstring's rule): the first of ``degrees`` (default
    ``model_shard_degrees``) whose compiled decode step fits ``device_memory_bytes`` less
    ``headroom``; without a budget, the first, uncompiled. ``model`` gives the structure (an
    ``nnx.eval_shape`` model will do), ``params`` (real or abstract: ``nnx.split``'s, as the
    engine takes them) the leaves to place."""
    degrees = list(degrees or model_shard_degrees(len(devices)))
    bad = [d for d in degrees if d < 1 or len(devices) % d]
    if bad:
        raise ValueError(f"Decode tensor-parallel degrees {bad} do not divide the "
                         f"{len(devices)} devices: use one of {model_shard_degrees(len(devices))}.")
    if device_memory_bytes is None:
        mesh = make_mesh(list(devices), degrees[0])
        return DecodeLayout(degrees[0], mesh, decode_shardings(params, mesh))
    usable, tried = int(device_memory_bytes * (1 - headroom)), {}
    for mp in degrees:
        mesh = make_mesh(list(devices), mp)
        shardings = decode_shardings(params, mesh)
        tried[mp] = None
        if held_bytes(params, shardings) > usable:
            continue  # the weights alone do not fit: no need to compile
        tried[mp] = peak_bytes(compile_decode_step(model, params, mesh, shardings, max_seqs,
                                                   max_len, cache_dtype, steps_per_sync))
        if tried[mp] <= usable:
            return DecodeLayout(mp, mesh, shardings, tried[mp], tried)
    measured = {d: f"{p / 2 ** 30:.2f} GiB" if p else "weights alone over" for d, p in tried.items()}
    raise ValueError(f"No decode layout fits {usable / 2 ** 30:.2f} GiB a device ({headroom:.0%} "
                     f"kept free) with {max_seqs} rows of {max_len} slots: peaks by "
                     f"tensor-parallel degree {measured}. Lower the engine's rows or max_len, "
                     "or decode in bfloat16.")


def to_layout(tree: Any, shardings: Any) -> Any:
    """``tree`` (device arrays) placed by ``shardings``, leaf by leaf: each copied, waited for,
    and its source freed, so that no more than one leaf is held twice. A leaf already placed so
    is returned as it is (shared, not copied). The source arrays are deleted: drop them."""
    def move(x, sharding):
        if x.sharding.is_equivalent_to(sharding, x.ndim):
            return x
        moved = jax.device_put(x, sharding).block_until_ready()
        x.delete()
        return moved
    return jax.tree.map(move, tree, shardings)
