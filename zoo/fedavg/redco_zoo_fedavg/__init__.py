"""FedAvg (McMahan et al. 2017) through Redco's three functions: ``redco zoo run fedavg`` and
``redco new --template fedavg``. The three functions are in ``redco_zoo_fedavg.pipeline``."""
from redco.plugins import deferred_exports

# Imported on first use: redco loads this package's plugin module without its pipeline.
__all__, __getattr__ = deferred_exports(__name__, {
    "pipeline": ["accuracy", "fedavg", "load_digits", "split_clients", "train_locally"],
})
