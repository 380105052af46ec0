"""How ``redco`` finds this package (its ``redco`` entry point): the ``maml`` pipeline,
imported only when it runs or shows its flags, and the ``maml`` template."""
import os

from redco.plugins import zoo_hooks

DESCRIPTION = "MAML: meta-learn a sinusoid regressor that adapts in one gradient step; MSE"

register_zoo_pipelines, register_templates = zoo_hooks(
    "maml", "redco_zoo_maml.pipeline:MAMLPipeline", DESCRIPTION,
    os.path.dirname(os.path.abspath(__file__)))
