"""How ``redco`` finds this package (its ``redco`` entry point): the ``seq2seq`` pipeline,
imported only when it runs or shows its flags, and the ``seq2seq`` template."""
import os

from redco.plugins import zoo_hooks

DESCRIPTION = "text-to-text: train an encoder-decoder (T5, flan-T5); ROUGE and exact match"

register_zoo_pipelines, register_templates = zoo_hooks(
    "seq2seq", "redco_zoo_seq2seq.pipeline:Seq2SeqPipeline", DESCRIPTION,
    os.path.dirname(os.path.abspath(__file__)))
