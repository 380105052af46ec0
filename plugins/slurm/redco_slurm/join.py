"""Joining a run from inside a SLURM job: what the ``slurm`` launcher's ``detect``, ``explain`` and
``initialize`` do.

A process belongs to a SLURM run when it is a task of an ``srun`` step with more than one task.
JAX's own SLURM detection then finds everything: the process id (``SLURM_PROCID``), the count
(``SLURM_NTASKS``) and the coordinator (the first node of ``SLURM_STEP_NODELIST``, port
``SLURM_JOB_ID % 4096 + 61440`` unless ``JAX_COORDINATOR_PORT`` is set). What redco adds:

* explicit ``Deployer`` process arguments win: the launcher stands aside
  (``redco_ip.join.explicit``);
* in the bare body of an sbatch script (a job of several tasks, but no step) the ``REDCO_*``
  variables of ``redco launch --launcher ip`` win; without them the launcher is detected anyway,
  so that ``initialize`` can say "run it through srun" instead of jax's obscure error;
* one task per node gets all of the node's devices (jax would keep the ``SLURM_LOCALID``-th one).
"""
from __future__ import annotations

import os

import jax

from redco import _private
from redco_ip import IP_ENV
from redco_ip.join import HEARTBEAT_TIMEOUT_S, as_int, check_process_count, explicit


def n_tasks() -> int:
    """The number of tasks of this step (or job), 1 outside SLURM."""
    for var in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 1


def in_step() -> bool:
    """Is this process a task of an ``srun`` step (not the batch script itself)?"""
    return "SLURM_STEP_ID" in os.environ or "SLURM_STEPID" in os.environ \
        or "SLURM_STEP_NODELIST" in os.environ


def tasks_on_this_node() -> int | None:
    """How many tasks of this step run on this node (``SLURM_STEP_TASKS_PER_NODE`` reads like
    ``2(x3),1``, one entry per node, in ``SLURM_NODEID`` order); None when unknown."""
    spec, node = os.environ.get("SLURM_STEP_TASKS_PER_NODE"), os.environ.get("SLURM_NODEID")
    if not spec or node is None or not node.isdigit():
        return None
    counts: list[int] = []
    for part in spec.split(","):
        n, _, repeat = part.partition("(x")
        counts += [int(n)] * (int(repeat.rstrip(")")) if repeat else 1)
    return counts[int(node)] if int(node) < len(counts) else None


def coordinator() -> str:
    """The coordinator JAX derives from the SLURM variables, for ``explain``."""
    return _private.slurm_coordinator_address() or "unknown (no SLURM_STEP_NODELIST)"


def detect(config: dict) -> bool:
    if explicit(config) or "SLURM_JOB_ID" not in os.environ or n_tasks() < 2:
        return False
    # In the bare body of an sbatch script the REDCO_* variables of `redco launch --launcher ip`
    # win; without them, initialize() says to run through srun.
    return in_step() or not os.environ.get(IP_ENV["n_processes"])


def explain(config: dict) -> str:
    if explicit(config):
        return "Deployer process arguments were given"
    if "SLURM_JOB_ID" not in os.environ:
        return "not in a SLURM job (no SLURM_JOB_ID)"
    job, n = os.environ["SLURM_JOB_ID"], n_tasks()
    if n < 2:
        return f"SLURM job {job} with {n} task"
    if not in_step():
        return (f"SLURM job {job} with {n} tasks, but this is the batch script itself, not a task "
                "of an srun step")
    return (f"task {os.environ.get('SLURM_PROCID')} of {n} of step "
            f"{os.environ.get('SLURM_STEP_ID', os.environ.get('SLURM_STEPID'))} of SLURM job {job} "
            f"on {os.environ.get('SLURM_STEP_NODELIST')}; coordinator {coordinator()}")


def local_device_ids(config: dict) -> list[int] | None:
    """``Deployer(n_local_devices=k)``: the first k; one task on this node: all of them (``[]``
    turns jax's one-device-per-task restriction off); several: jax's default (device
    ``SLURM_LOCALID``)."""
    if config.get("n_local_devices"):
        return list(range(config["n_local_devices"]))
    return [] if tasks_on_this_node() == 1 else None


def initialize(config: dict) -> None:
    n = n_tasks()
    if not in_step():
        raise RuntimeError(
            f"This is the body of the sbatch script of SLURM job {os.environ.get('SLURM_JOB_ID')} "
            f"({n} tasks), not a task of a job step, so there is nothing to join: run the command "
            "through srun (`srun python train.py ...` in the script), or let `redco launch "
            "--launcher slurm ... -- python train.py ...` write and submit the script.")
    missing = [v for v in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NODELIST")
               if v not in os.environ]
    if missing:
        raise RuntimeError(f"SLURM step without {', '.join(missing)}: cannot find this task's id "
                           "or the coordinator. Start the tasks with srun.")
    check_process_count(n, as_int("SLURM_PROCID", os.environ["SLURM_PROCID"]), "SLURM")
    jax.distributed.initialize(cluster_detection_method="slurm",
                               local_device_ids=local_device_ids(config),
                               heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S)
