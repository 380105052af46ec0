"""``redco launch --launcher xmanager``: an XManager experiment whose work unit is a group of
``n_processes`` copies of your command on this machine, joined by redco's ``ip`` launcher.

Each job is an ``xm.binary`` of the command with the ``REDCO_*`` variables of
``redco.launch.ip_commands`` in its environment, so the unchanged script's ``Deployer()`` joins
the others. XManager's local executor runs them as subprocesses (no Docker, no Bazel, no cloud
account; its experiment database lives under ``~/.xmanager``). XManager is optional:
``pip install xmanager``.
"""
from __future__ import annotations

import asyncio
import shutil
import sys

from redco.launch import LaunchError, ip_commands


def launch(command: list[str], n_processes: int, port: int, title: str = "redco") -> int:
    """Run ``command`` as ``n_processes`` jobs of one XManager work unit; wait; return 0, or 1
    when a job failed (XManager's error, naming the process, is printed)."""
    try:
        from absl import flags
        from xmanager import xm, xm_local
    except ImportError as e:
        raise LaunchError(f"--launcher xmanager needs XManager ({e}): pip install xmanager") \
            from None
    rows = ip_commands(command, ["localhost"] * n_processes, port)
    if not flags.FLAGS.is_parsed():
        flags.FLAGS(sys.argv[:1])  # XManager reads absl flags (its database settings)

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
