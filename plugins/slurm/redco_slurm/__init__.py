"""redco-slurm: everything Redco knows about SLURM, as one launcher plugin named ``slurm``.

* Joining (``join.py``): in a task of an ``srun`` step of several tasks, an unchanged script's
  ``Deployer()`` joins the run through JAX's SLURM cluster detection; ``redco doctor`` explains
  why it does or does not apply.
* Submitting (``sbatch.py``): ``redco launch --launcher slurm --nodes 2 --ntasks_per_node 4
  [--wait] -- python train.py ...`` writes an sbatch script running the command under ``srun``
  and submits it; ``--wait`` follows the job and exits with its exit code.

Installing the distribution registers the launcher through the ``redco`` entry-point group. Its
hook is ``tryfirst``: a task of a SLURM step must join as one even when ``REDCO_*`` variables of
the ``ip`` launcher (``redco-ip``, a plain hook too, so otherwise tried in entry-point discovery
order) came along in the environment, as ``sbatch`` passes the submitting shell's environment on.
The launcher stands aside when ``Deployer`` process arguments are given.
"""
from __future__ import annotations

import argparse

import redco
from redco.protocols import Launcher
from redco_slurm import join
from redco_slurm.sbatch import SlurmJob, launch_slurm


class SlurmLauncher(Launcher):
    """A task of an ``srun`` step with more than one task joins; ``redco launch`` submits."""
    description = "write an sbatch script running the command under srun, and submit it"

    def detect(self, config: dict) -> bool:
        return join.detect(config)

    def explain(self, config: dict) -> str:
        return join.explain(config)

    def initialize(self, config: dict) -> None:
        join.initialize(config)

    def add_arguments(self, group: argparse._ArgumentGroup) -> None:
        group.add_argument("--nodes", type=int, default=1)
        group.add_argument("--ntasks_per_node", "--ntasks-per-node", type=int, default=1,
                           help="processes per node (one per GPU, or one per node with all of them)")
        group.add_argument("--partition")
        group.add_argument("--time", help="time limit, e.g. 1:00:00")
        group.add_argument("--cpus_per_task", "--cpus-per-task", type=int)
        group.add_argument("--gpus_per_node", "--gpus-per-node", type=int)
        group.add_argument("--job_name", "--job-name", default="redco")
        group.add_argument("--requeue", action="store_true", help="SIGTERM the tasks "
                           "--signal_before seconds before the time limit (or on scancel "
                           "--signal=TERM): redco saves a step checkpoint and exits 143, and the "
                           "job requeues itself and resumes from it")
        group.add_argument("--signal_before", "--signal-before", type=int, default=120, metavar="SECONDS",
                           help="with --requeue: how long before the time limit (default 120)")
        group.add_argument("--sbatch", action="append", default=[], metavar="OPTION",
                           help="another #SBATCH option, e.g. --sbatch=--account=abc or "
                           "--sbatch=--requeue (repeatable)")
        group.add_argument("--workdir", default=".",
                           help="where the script and the job's output file go (default: here)")
        group.add_argument("--dry_run", "--dry-run", action="store_true",
                           help="print the script, submit nothing")
        group.add_argument("--wait", action="store_true", help="poll squeue until the job ends, "
                           "print its output, exit with its exit code")

    def submit(self, command: list[str], args: argparse.Namespace) -> int:
        job = SlurmJob(command=command, nodes=args.nodes, ntasks_per_node=args.ntasks_per_node,
                       job_name=args.job_name, directory=args.workdir, partition=args.partition,
                       time=args.time, cpus_per_task=args.cpus_per_task,
                       gpus_per_node=args.gpus_per_node, requeue=args.requeue,
                       signal_before_s=args.signal_before, extra=tuple(args.sbatch))
        return launch_slurm(job, dry_run=args.dry_run, wait=args.wait)


@redco.hookimpl(tryfirst=True)
def register_launchers(register):
    register("slurm", SlurmLauncher())
