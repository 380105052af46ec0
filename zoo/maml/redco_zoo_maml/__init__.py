"""MAML on sinusoid regression through Redco's three functions."""
from redco.plugins import deferred_exports

# Imported on first use: redco loads this package's plugin module without its pipeline.
__all__, __getattr__ = deferred_exports(__name__, {
    "pipeline": ["SinusoidTasks", "adapt", "collate_fn", "init_mlp", "loss_fn", "mlp", "mse",
                 "pred_fn", "query_mse"],
})
