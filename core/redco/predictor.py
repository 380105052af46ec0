"""``Predictor``: runs the user's ``collate_fn`` and ``pred_fn`` over a list of examples."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np
import tqdm
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from redco import sequence_split
from redco.compat import PredictorV04, refuse_unknown
from redco.data import by_name, check_batch_leading, check_collated, n_full_batches
from redco.deployer import Deployer
from redco.in_flight import read_in_order
from redco.sharding import Rules, is_rule_set

PRED_ARGS = ("rng", "params", "batch")


class Predictor(PredictorV04):
    """Predicts with ``pred_fn(rng, params, batch) -> pytree with a leading batch dim``.

    ``predict`` returns exactly one output per example, in order: ``output_fn(batch_preds)``
    turns a batch of (numpy) predictions into a list, else each example gets its slice of the
    prediction pytree. The rng argument may also be named ``pred_rng``.
    """

    def __init__(self, deployer: Deployer, collate_fn: Callable, pred_fn: Callable,
                 output_fn: Callable | None = None, params_sharding_rules: Rules | None = None):
        self.deployer = deployer
        self.collate_fn = collate_fn
        self.output_fn = output_fn
        self.params_sharding_rules = params_sharding_rules
        self._pred_step = jax.jit(self._split(by_name(pred_fn, PRED_ARGS)))

    def _split(self, pred_fn: Callable) -> Callable:
        """``pred_fn`` traced with the sequence split over the deployer's ``cp`` devices, as a
        train step is (``redco.sequence_split``): a long prompt is read split, its cache
        held split."""
        def split_pred_fn(*args):
            with sequence_split.splitting(self.deployer.mesh, self.deployer.context_strategy):
                return pred_fn(*args)
        return split_pred_fn

    def _place(self, params):
        """Shard params that are not on this mesh yet (a trainer's already are) by the layout
        this deployer decided, or decide it now (from the rule set's names: ``pred_fn`` is not
        traced, as generation loops hide the dataflow)."""
        def on_mesh(x):
            return isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding) \
                and x.sharding.mesh == self.deployer.mesh
        if all(on_mesh(x) for x in jax.tree.leaves(params)):
            return params
        rules = self.params_sharding_rules
        if is_rule_set(rules) and self.deployer.params_sharding_rules is not None:
            rules = self.deployer.params_sharding_rules  # decided by a Trainer's first batch
        else:
            rules = self.deployer.decide_layout(params, rules).rules
        return jax.device_put(params, self.deployer.get_params_shardings(params, rules))

    def predict(self, examples: Sequence, per_device_batch_size: int, params: Any,
                desc: str | None = "predict", **v04) -> list:
        """One output per example, in order. (Redco 0.4.x's ``params_replicated``,
        ``params_sharded`` and ``params_meshed`` need no saying: placed params are seen as such.)"""
        refuse_unknown("predict()", v04, {"params_replicated", "params_sharded", "params_meshed"})
        n_full_batches(len(examples), 1, "examples")
        params = self._place(params)
        batch_size = self.deployer.get_global_batch_size(per_device_batch_size)
        n_batches = -(-len(examples) // batch_size)
        last = len(examples) - 1  # the last batch is padded with the last example
        rng = jax.random.PRNGKey(self.deployer.jax_seed + 1)

        def dispatched():
            for i in tqdm.trange(n_batches, desc=desc or "predict",
                                 disable=not self.deployer.show_progress,
                                 dynamic_ncols=True, leave=False):
                rows = [examples[min(j, last)] for j in range(i * batch_size, (i + 1) * batch_size)]
                batch = self.deployer.make_batch(rows, self.collate_fn)
                yield self._pred_step(jax.random.fold_in(rng, i), params, batch)
        outputs = []
        for preds in read_in_order(dispatched(), lambda preds: multihost_utils.process_allgather(
                preds, tiled=True)):  # the next batch runs while this one is read back
            if not outputs and self.output_fn is None:
                check_batch_leading(preds, batch_size, "pred_fn output")
            outputs.extend(self.per_example(preds, batch_size))
        return outputs[:len(examples)]

    def per_example(self, preds: Any, batch_size: int) -> list:
        """A batch's (numpy) predictions as one output per example: ``output_fn``'s, else each
        example's slice of the prediction pytree."""
        if self.output_fn is None:
            return [jax.tree.map(lambda x: x[j], preds) for j in range(batch_size)]
        outputs = list(self.output_fn(preds))
        if len(outputs) != batch_size:
            raise ValueError(f"output_fn returned {len(outputs)} outputs for a batch of "
                             f"{batch_size} examples: return one per example.")
        return outputs

    def traced_preds(self, examples: Sequence, per_device_batch_size: int,
                     params: Any) -> tuple[Any, int]:
        """Zeros shaped like ``pred_fn``'s output for the first global batch of ``examples``,
        and that batch's size: ``pred_fn`` is traced (``jax.eval_shape``), never compiled."""
        batch_size = self.deployer.get_global_batch_size(per_device_batch_size)
        rows = [examples[min(i, len(examples) - 1)] for i in range(batch_size)]
        batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                             check_collated(self.collate_fn(rows), batch_size))
        rng = jax.eval_shape(jax.random.PRNGKey, 0)
        shapes = jax.eval_shape(self._pred_step, rng, params, batch)
        if self.output_fn is None:
            check_batch_leading(shapes, batch_size, "pred_fn output")
        return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes), batch_size
