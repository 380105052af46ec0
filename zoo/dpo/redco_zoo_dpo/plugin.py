"""How ``redco`` finds this package (its ``redco`` entry point): the ``dpo`` pipeline,
imported only when it runs or shows its flags, and the ``dpo`` template."""
import os

from redco.plugins import zoo_hooks

DESCRIPTION = ("preference optimisation (DPO) on chats: chosen and rejected replies to a "
               "prompt; preference accuracy and margins")

register_zoo_pipelines, register_templates = zoo_hooks(
    "dpo", "redco_zoo_dpo.pipeline:DPOPipeline", DESCRIPTION,
    os.path.dirname(os.path.abspath(__file__)))
