"""Causal language modelling through Redco's three functions."""
from redco.plugins import deferred_exports

# Imported on first use: redco loads this package's plugin module without its pipeline.
__all__, __getattr__ = deferred_exports(__name__, {
    "pipeline": ["collate_fn", "loss_fn", "pred_fn"],
})
