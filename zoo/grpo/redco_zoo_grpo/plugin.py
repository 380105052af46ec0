"""How ``redco`` finds this package (its ``redco`` entry point): the ``grpo`` pipeline,
imported only when it runs or shows its flags, and the ``grpo`` template."""
import os

from redco.plugins import hookimpl, zoo_hooks
from redco_zoo_grpo.environments import Calculator

DESCRIPTION = ("GRPO: G samples per prompt, rewards from a Python function, group-normalised "
               "advantages, the clipped loss (GRPO, Dr. GRPO, DAPO or GSPO); greedy reward")

register_zoo_pipelines, register_templates = zoo_hooks(
    "grpo", "redco_zoo_grpo.pipeline:GRPOPipeline", DESCRIPTION,
    os.path.dirname(os.path.abspath(__file__)))


@hookimpl(trylast=True)
def register_environments(register):
    register("calculator", Calculator)
