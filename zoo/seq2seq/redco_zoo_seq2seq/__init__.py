"""Text-to-text through Redco's three functions."""
from redco_zoo_seq2seq.pipeline import collate_fn, loss_fn, metric_fn, pred_fn

__all__ = ["collate_fn", "loss_fn", "metric_fn", "pred_fn"]
