"""Direct preference optimisation through Redco's three functions (``pipeline.py``)."""
from redco_zoo_dpo.pipeline import collate_fn, loss_fn, metric_fn, pred_fn

__all__ = ["collate_fn", "loss_fn", "metric_fn", "pred_fn"]
