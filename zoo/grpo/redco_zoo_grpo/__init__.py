"""Group relative policy optimisation through Redco's three functions (``pipeline.py``): the
loss's pieces (``loss.py``), the rounds of sampling, scoring and updates (``rollout.py``), and
rewards from a Python function (``rewards.py``)."""
from redco.plugins import deferred_exports

# Imported on first use: redco loads this package's plugin module without its pipeline.
__all__, __getattr__ = deferred_exports(__name__, {
    "pipeline": ["collate_fn", "loss_fn", "pred_fn"],
    "rewards": ["exact_match", "regex_match"],
    "rollout": ["GRPO", "GRPOConfig"],
})
