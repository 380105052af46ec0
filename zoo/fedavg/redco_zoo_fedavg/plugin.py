"""How ``redco`` finds this package (its ``redco`` entry point): the ``fedavg`` pipeline,
imported only when it runs or shows its flags, and the ``fedavg`` template."""
import os

from redco.plugins import zoo_hooks

DESCRIPTION = "federated averaging (FedAvg): an MLP on sklearn digits split over clients"

register_zoo_pipelines, register_templates = zoo_hooks(
    "fedavg", "redco_zoo_fedavg.pipeline:FedAvgPipeline", DESCRIPTION,
    os.path.dirname(os.path.abspath(__file__)))
