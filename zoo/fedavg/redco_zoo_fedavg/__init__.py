"""FedAvg (McMahan et al. 2017) through Redco's three functions: ``redco zoo run fedavg`` and
``redco new --template fedavg``. The three functions are in ``redco_zoo_fedavg.pipeline``."""
from redco_zoo_fedavg.pipeline import accuracy, fedavg, load_digits, split_clients, train_locally

__all__ = ["accuracy", "fedavg", "load_digits", "split_clients", "train_locally"]
