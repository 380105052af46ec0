"""How ``redco`` finds this package (its ``redco`` entry point): the ``sft`` pipeline,
imported only when it runs or shows its flags, and the ``sft`` template."""
import os

from redco.plugins import zoo_hooks

DESCRIPTION = ("supervised fine-tuning on chats: the tokenizer's chat template, the loss on "
               "the assistant's tokens, chats packed into rows")

register_zoo_pipelines, register_templates = zoo_hooks(
    "sft", "redco_zoo_sft.pipeline:SFTPipeline", DESCRIPTION,
    os.path.dirname(os.path.abspath(__file__)))
