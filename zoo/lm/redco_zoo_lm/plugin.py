"""How ``redco`` finds this package (its ``redco`` entry point): the ``lm`` pipeline,
imported only when it runs or shows its flags, and the ``lm`` template."""
import os

from redco.plugins import hookimpl, zoo_hooks
from redco_zoo_lm.tokenizing import TokenizeCommand

DESCRIPTION = ("causal LM: train a decoder (Llama 1-3, Mistral, Qwen2/3, Gemma 2/3, Phi-3/4, "
               "OLMo 2, Qwen3-MoE, Mixtral, GPT-2) on text, or on "
               "token files (.bin, a folder of them, or a weighted mixture; documents packed "
               "into rows); perplexity")

register_zoo_pipelines, register_templates = zoo_hooks(
    "lm", "redco_zoo_lm.pipeline:LMPipeline", DESCRIPTION,
    os.path.dirname(os.path.abspath(__file__)))


@hookimpl
def register_commands(register):
    register("tokenize", TokenizeCommand())
