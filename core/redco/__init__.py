"""Redco: distributed training and inference from three functions.

Write ``collate_fn``, ``loss_fn`` and ``pred_fn``; ``Deployer``, ``Trainer`` and ``Predictor``
do the rest (data and tensor parallelism, multiple hosts, checkpoints, logging, randomness).
"""
from redco.deployer import Deployer
from redco.plugins import hookimpl
from redco.predictor import Predictor
from redco.trainer import Trainer, TrainState

__all__ = ["Deployer", "Predictor", "Trainer", "TrainState", "hookimpl"]
__version__ = "0.5.0"
