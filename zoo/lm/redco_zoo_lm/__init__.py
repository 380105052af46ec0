"""Causal language modelling through Redco's three functions."""
from redco_zoo_lm.pipeline import collate_fn, loss_fn, pred_fn

__all__ = ["collate_fn", "loss_fn", "pred_fn"]
