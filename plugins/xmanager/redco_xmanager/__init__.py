"""redco-xmanager: ``redco launch --launcher xmanager --n_processes 2 -- python train.py ...`` runs
the processes of one run as one XManager work unit on this machine (``work_unit.py``).

A submitter only: the processes join through the ``ip`` launcher (``redco-ip``), whose ``REDCO_*``
variables each job gets, on host 0's coordinator port ``--port`` (the ``ip`` launcher's option,
shared: two launchers cannot both add an option of the same name to ``redco launch``, hence
also ``--title`` for the experiment, not ``--job_name``, which is ``slurm``'s).
"""
from __future__ import annotations

import argparse

import redco
from redco.protocols import Launcher
from redco_xmanager.work_unit import run_work_unit


class XManagerLauncher(Launcher):
    """Starts a run as one XManager work unit; does not join runs (``ip`` does)."""
    description = "one XManager work unit on this machine, processes joined by ip on --port"

    def add_arguments(self, group: argparse._ArgumentGroup) -> None:
        group.add_argument("--n_processes", "--n-processes", type=int, default=2,
                           help="processes (jobs) to run")
        group.add_argument("--title", default="redco", help="the XManager experiment's title")

    def submit(self, command: list[str], args: argparse.Namespace) -> int:
        return run_work_unit(command, args.n_processes, args.port, args.title)


@redco.hookimpl
def register_launchers(register):
    register("xmanager", XManagerLauncher())
