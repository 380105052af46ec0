"""Expert parallelism (EP): an MoE block's experts split over the mesh's ``dp`` axis, each token
sent to the devices holding the experts it picked and its outputs sent back.

**Layout.** With ``d`` devices on ``dp``, device ``j`` holds experts ``j*E/d .. (j+1)*E/d - 1``:
the stacked weights (E, H, I) / (E, I, H) are split on E over ``dp`` (``sharding_rules``), and
on I over ``mp`` as tensor parallelism splits a dense MLP; gpt-oss's expert biases (E, I) /
(E, H) are split on E with them, and so are a quantised base's codes and scales
(``redco_zoo_models.quantized_experts``), dequantised on each device for its own experts.
The batch is split over ``dp`` as always, so each device routes its own ``n = N/d`` tokens
(the router runs outside, on the whole batch as XLA lays it out: the auxiliary losses and loads
are the single-device ones).

**One step, inside ``jax.shard_map`` manual over ``dp`` only** (``mp`` stays automatic, so the
experts' matmuls are split over it as XLA likes):

1. *Dispatch by capacity, per source device.* Each device gives every expert ``C`` slots for
   its ``n`` tokens and fills them first choices first, in its token order, then second choices
   (``redco_zoo_models.slots``, as ``moe.MoE.with_capacity`` does on one device); a pair past
   its expert's ``C`` slots is dropped. The device's ``(E, C, H)`` buffer holds the tokens in
   their slots (gathered by index, not a one-hot (n, E, C) einsum, whose cost grows as
   ``n * E * C * H``, i.e. with the square of the tokens: ``bench/moe_step.py``).
2. *There.* The buffer, cut on E into ``d`` parts of ``E/d`` experts, goes part ``j`` to device
   ``j`` (``all_to_all``): each device then holds ``(d sources, E/d, C, H)``, every source's
   tokens for its own experts.
3. *Compute.* Each local expert takes its ``d * C`` rows through its weights in one batched
   matmul (``moe.Experts.batched`` with the local share of the weights).
4. *Back.* The reverse ``all_to_all`` returns each source its ``(E, C, H)`` outputs, and each
   token reads its pairs' rows, weighted by the router (``combine``, as on one device).
   Llama 4's experts read router-scaled inputs (``expert_input_scaled``): there the rows are
   weighted as they are written in step 1, and step 4 sums them unweighted.

**Capacity.** With ``capacity_factor`` each expert takes ``ceil(capacity_factor * n * top_k /
E)`` pairs *from each source device* (``MoEConfig.capacity`` of the device's ``n`` tokens): the
drop rule is per source device, not the single device's over the whole batch, so the same
factor can drop other pairs (the tests check it against that rule written out). Dropless
(``capacity_factor=None``) is the same path with ``C = n``, a capacity no (source, expert) pair
can exceed (a token picks an expert at most once): nothing is dropped and the result is the
single device's. The grouped-matmul dropless path (``jax.lax.ragged_dot``) would need
``jax.lax.ragged_all_to_all`` to move uneven groups, which XLA:CPU refuses; the fixed ``C = n``
buffer costs ``E/top_k`` times the pairs' memory and expert compute instead.

**Switch.** ``expert_parallel(mesh)`` is a trace-time context like ``redco.sequence_split``:
an MoE block traced inside it (``current()``) runs as above; outside it, on one device's view.
Entered with the step's ``params``, it also tells ``redco.fsdp`` to leave the expert weights
split: FSDP would all-gather every ``dp``-split weight before its layer, undoing EP.
``as_laid_out(weights)`` (the zoo decoder enters it around its layers) enters it by itself
when the step laid the experts out for it: every expert weight declared (``redco.fsdp.declared``)
split on its experts over ``dp``, as the ``auto+ep`` and ``auto+fsdp+ep`` rule sets split them
(``redco.builtins.rules``). So a ``Trainer`` with those rules, given or picked by the layout
planner (``Deployer(n_model_shards="auto")``, which compiles the step so, all_to_all and all),
runs EP with no other switch; ``redco zoo run ... --expert_parallel`` gives the rules
(``for_trainer``).

Bad input is refused while tracing, before anything compiles: experts that do not divide by
the ``dp`` degree (``check``); ``top_k`` above the expert count and a non-positive capacity
factor (any positive one leaves every expert a slot) are refused by ``MoEConfig``. Tokens that
do not divide by the degree (a training step's batch always does: its rows are split over
``dp``; the ``Trainer`` traces one device's batch to read the layout off it) are padded with
tokens that pick no expert (their one-hot over E is all zero): they take no slot and are cut
off the output.
"""
from __future__ import annotations

import contextlib
import re
import threading
from typing import Any, Iterator

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from redco import fsdp
from redco.layer_stacks import layers_of
from redco.tree_paths import named_leaves
from redco_zoo_models.slots import combine, dispatch, slots

AXIS = "dp"
# the experts' weights and biases, and a quantised weight's scales (``quantized_experts``)
EXPERT_WEIGHTS = re.compile(r"(^|/)experts/(gate_proj|up_proj|down_proj)"
                            r"(_bias|_scale|_absmax|_absmax_scale|_absmax_offset)?$")
_state = threading.local()


def sharding_rules() -> list[tuple[str, P]]:
    """Rules placing the experts' stacked weights for EP: E over ``dp``, I over ``mp``. Give
    them as overrides: ``deployer.get_sharding_rules(params, rules=sharding_rules())``."""
    return [(r"(^|/)experts/(gate_proj|up_proj)$", P(AXIS, None, "mp")),
            (r"(^|/)experts/down_proj$", P(AXIS, "mp", None)),
            (r"(^|/)experts/(gate_proj|up_proj)_bias$", P(AXIS, "mp")),  # (gpt-oss)
            (r"(^|/)experts/down_proj_bias$", P(AXIS, None))]


@contextlib.contextmanager
def expert_parallel(mesh: Mesh | None, params: Any = None) -> Iterator[None]:
    """Trace the MoE blocks inside with their experts split over ``mesh``'s ``dp`` axis
    (nothing when it has none, or one device on it). ``params``: the step's params, whose
    expert weights ``redco.fsdp`` must then leave split rather than gather per layer."""
    if mesh is None or AXIS not in mesh.axis_names or mesh.shape[AXIS] == 1:
        yield
        return
    if params is not None:
        fsdp.keep_split([leaf for path, leaf in named_leaves(params)
                         if EXPERT_WEIGHTS.search(path)])
    previous, _state.mesh = getattr(_state, "mesh", None), mesh
    try:
        yield
    finally:
        _state.mesh = previous


def for_trainer(params: Any, deployer) -> list:
    """The ``params_sharding_rules`` for a ``Trainer`` of a model whose MoE blocks run
    expert-parallel: the deployer's rules for ``params`` behind ``sharding_rules()``."""
    return deployer.get_sharding_rules(params, rules=sharding_rules())


@contextlib.contextmanager
def as_laid_out(weights: list[tuple[str, Any]]) -> Iterator[None]:
    """``expert_parallel`` over the mesh the step split the expert weights of ``weights``
    (``(path, leaf)`` pairs) on, when it declared every one split on its experts over ``dp``
    (``redco.fsdp.declared``; a stacked layers' one, ``redco.layer_stacks``, on the axis after
    its layers'); else nothing."""
    experts = [(path, leaf) for path, leaf in weights if EXPERT_WEIGHTS.search(path)]
    shardings = [(int(layers_of(path) is not None), fsdp.declared(leaf)) for path, leaf in experts]
    if not experts or not all(s is not None and len(s.spec) > axis and s.spec[axis] == AXIS
                              for axis, s in shardings):
        yield
        return
    fsdp.keep_split([leaf for _, leaf in experts])
    with expert_parallel(shardings[0][1].mesh):
        yield


def current() -> Mesh | None:
    """The mesh whose ``dp`` axis splits the experts while ``expert_parallel`` is in force."""
    return getattr(_state, "mesh", None)


def check(n_experts: int, degree: int) -> None:
    """Refuse experts that do not split evenly over the devices, naming the fix."""
    if n_experts % degree:
        raise ValueError(f"n_experts={n_experts} do not split over the {degree} devices of "
                         f"expert parallelism (dp={degree}): use a data-parallel degree that "
                         f"divides {n_experts}, or leave expert parallelism off.")


def dispatched(moe, tokens, chosen, weights, mesh: Mesh):
    """``(y, share of pairs dropped)`` of ``moe`` (a ``moe.MoE``) for ``tokens`` (N, H) routed
    to ``chosen`` (N, k) with ``weights``, its experts split over ``mesh``'s ``dp`` axis."""
    cfg, degree = moe.cfg, mesh.shape[AXIS]
    check(cfg.n_experts, degree)
    n_tokens = tokens.shape[0]
    pad = ((0, -n_tokens % degree), (0, 0))  # tokens that pick no expert (module docstring)
    tokens, weights = jnp.pad(tokens, pad), jnp.pad(weights, pad)
    chosen = jnp.pad(chosen, pad, constant_values=cfg.n_experts)
    n = tokens.shape[0] // degree
    # dropless: C = n, which no (source, expert) pair can exceed (ragged_all_to_all, which
    # would move only the pairs, is refused by XLA:CPU); else each source device's capacity
    capacity = n if cfg.capacity_factor is None else min(n, cfg.capacity(n))
    experts = moe.experts
    expert_weights = experts.weights()  # (biases too, each split with its experts)
    split = P(AXIS)
    run = jax.shard_map(
        lambda *a: _local(experts.batched, *a, n_experts=cfg.n_experts, capacity=capacity,
                          input_scaled=cfg.expert_input_scaled),
        mesh=mesh, in_specs=(split,) * (3 + len(expert_weights)), out_specs=(split, P()),
        axis_names={AXIS})
    y, kept = run(tokens, chosen, weights, *expert_weights)
    return y[:n_tokens], (1 - kept / (n_tokens * cfg.top_k)).astype(jnp.float32)


def _local(batched, tokens, chosen, weights, *expert_weights, n_experts: int, capacity: int,
           input_scaled: bool):
    """One device's share (steps 1-4 of the module docstring): ``(its tokens' outputs, pairs
    kept on every device)``; ``expert_weights``: its experts' (``moe.Experts.weights``).
    ``input_scaled`` (Llama 4): the router's weights scale the rows sent, not those returned."""
    degree = jax.lax.psum(1, AXIS)
    places, kept = slots(chosen, n_experts, capacity)
    buffer = dispatch(tokens, places, n_experts, capacity,  # (E, C, H)
                      weights if input_scaled else None)
    weights = jnp.ones_like(weights) if input_scaled else weights
    local = n_experts // degree
    sent = buffer.reshape(degree, local, capacity, -1)  # part j: device j's experts
    received = jax.lax.all_to_all(sent, AXIS, 0, 0)  # (sources, E/d, C, H)
    rows = received.transpose(1, 0, 2, 3).reshape(local, degree * capacity, -1)
    out = batched(rows, expert_weights).reshape(local, degree, capacity, -1)
    returned = jax.lax.all_to_all(out.transpose(1, 0, 2, 3), AXIS, 0, 0)  # (owners, E/d, C, H)
    y = combine(returned.reshape(n_experts, capacity, -1), places, weights)
    return y, jax.lax.psum(kept, AXIS)
