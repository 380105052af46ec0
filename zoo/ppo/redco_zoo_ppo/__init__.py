"""PPO on gymnasium environments through Redco's three functions."""
from redco.plugins import deferred_exports

# Imported on first use: redco loads this package's plugin module without its pipeline.
__all__, __getattr__ = deferred_exports(__name__, {
    "pipeline": ["Collector", "Iterations", "collate_fn", "loss_fn", "placeholder",
                 "pred_fn", "report", "train"],
})
