"""Image captioning through Redco's three functions."""
from redco_zoo_captioning.pipeline import collate_fn, loss_fn, metric_fn, pred_fn

__all__ = ["collate_fn", "loss_fn", "metric_fn", "pred_fn"]
