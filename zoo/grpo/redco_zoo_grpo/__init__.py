"""Group relative policy optimisation through Redco's three functions (``pipeline.py``): the
loss's pieces (``loss.py``), the rounds of sampling, scoring and updates (``rollout.py``), and
rewards from a Python function (``rewards.py``)."""
from redco_zoo_grpo.pipeline import collate_fn, loss_fn, pred_fn
from redco_zoo_grpo.rewards import exact_match, regex_match
from redco_zoo_grpo.rollout import GRPO, GRPOConfig

__all__ = ["GRPO", "GRPOConfig", "collate_fn", "exact_match", "loss_fn", "pred_fn",
           "regex_match"]
