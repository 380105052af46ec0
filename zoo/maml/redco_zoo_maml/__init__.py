"""MAML on sinusoid regression through Redco's three functions."""
from redco_zoo_maml.pipeline import (
    SinusoidTasks,
    adapt,
    collate_fn,
    init_mlp,
    loss_fn,
    mlp,
    mse,
    pred_fn,
    query_mse,
)

__all__ = ["SinusoidTasks", "adapt", "collate_fn", "init_mlp", "loss_fn", "mlp", "mse", "pred_fn",
           "query_mse"]
