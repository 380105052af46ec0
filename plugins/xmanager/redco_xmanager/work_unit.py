"""One XManager experiment whose work unit is a group of ``n_processes`` copies of the command on
this machine, each with the ``REDCO_*`` variables of ``redco_ip.ip_commands`` in
its environment, so the unchanged script's ``Deployer()`` joins the others through the
``ip`` launcher of ``redco-ip``.

Each job is an ``xm.binary`` of the command run by XManager's local executor as a subprocess (no
Docker, no Bazel, no cloud account); the experiment database lives under ``~/.xmanager``.
XManager is imported here, when a launch happens, so that loading the plugin (every ``redco``
command does) stays cheap.
"""
from __future__ import annotations

import asyncio
import shutil
import sys

from redco.protocols import LaunchError
from redco_ip import ip_commands


def _xmanager():
    try:
        from absl import flags
        from xmanager import xm, xm_local
    except ImportError as e:
        raise LaunchError(f"--launcher xmanager needs XManager ({e}): pip install redco-xmanager "
                          "installs it; reinstall it in this environment") from None
    if not flags.FLAGS.is_parsed():
        flags.FLAGS(sys.argv[:1])  # XManager reads absl flags (its database settings)
    return xm, xm_local


def run_work_unit(command: list[str], n_processes: int, port: int, title: str = "redco") -> int:
    """Run ``command`` as ``n_processes`` jobs of one XManager work unit and wait; return 0, or 1
    when a job failed (XManager's error, naming the job and its exit code, is printed)."""
    if n_processes < 1:
        raise LaunchError(f"--n_processes {n_processes} must be at least 1")
    rows = ip_commands(command, ["localhost"] * n_processes, port)
    xm, xm_local = _xmanager()

    async def run() -> None:
        async with xm_local.create_experiment(experiment_title=title) as experiment:
            [executable] = experiment.package([xm.binary(
                path=shutil.which(command[0]) or command[0], args=command[1:],
                executor_spec=xm_local.LocalSpec())])
            jobs = {f"process_{i}": xm.Job(
                executable, executor=xm_local.Local(experimental_stream_output=True), env_vars=env)
                for i, (_, env, _) in enumerate(rows)}
            unit = await experiment.add(xm.JobGroup(**jobs))
            await unit.wait_until_complete()
    try:
        asyncio.run(run())
    except xm.ExperimentUnitError as e:
        print(f"redco launch: the XManager work unit failed: {e}", file=sys.stderr)
        return 1
    return 0
