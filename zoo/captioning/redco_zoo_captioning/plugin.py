"""How ``redco`` finds this package (its ``redco`` entry point): the ``captioning`` pipeline,
imported only when it runs or shows its flags, and the ``captioning`` template."""
import os

from redco.plugins import zoo_hooks

DESCRIPTION = "image captioning: train a ViT + GPT-2 VisionEncoderDecoder; ROUGE, exact match"

register_zoo_pipelines, register_templates = zoo_hooks(
    "captioning", "redco_zoo_captioning.pipeline:CaptioningPipeline", DESCRIPTION,
    os.path.dirname(os.path.abspath(__file__)))
