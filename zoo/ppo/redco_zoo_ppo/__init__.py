"""PPO on gymnasium environments through Redco's three functions."""
from redco_zoo_ppo.pipeline import Collector, collate_fn, loss_fn, pred_fn, train

__all__ = ["Collector", "collate_fn", "loss_fn", "pred_fn", "train"]
