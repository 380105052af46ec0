"""PPO on gymnasium environments through Redco's three functions."""
from redco_zoo_ppo.pipeline import (
    Collector,
    Iterations,
    collate_fn,
    loss_fn,
    placeholder,
    pred_fn,
    report,
    train,
)

__all__ = ["Collector", "Iterations", "collate_fn", "loss_fn", "placeholder", "pred_fn", "report", "train"]
