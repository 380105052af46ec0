"""Submitting a run to SLURM: what ``redco launch --launcher slurm`` does.

``sbatch_script`` writes a script whose body runs the command under ``srun``, one JAX process per
task (each joins through this plugin's ``slurm`` launcher); ``submit`` hands it to ``sbatch``;
``wait_for_job`` asks the controller (``scontrol``) until the job has ended for good, copying its
output file as it grows, and returns the job's exit code (from ``scontrol``, or ``sacct``).

The script is preemption-friendly: its output file is opened in append mode and running it again
is safe, so a job that SLURM requeues (``--sbatch=--requeue``, or a partition that requeues
preempted jobs) continues where it stopped: redco's ``Trainer.fit`` resumes from the last step
checkpoint in its workdir.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import TextIO

from redco.protocols import LaunchError

# Job states after which a SLURM job never runs again (a requeued job is PENDING or REQUEUED).
DONE_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
               "PREEMPTED", "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT", "REVOKED"}


@dataclass
class SlurmJob:
    """What ``redco launch --launcher slurm`` submits; ``directory`` holds the script
    (``<job_name>.sbatch``) and the output (``<job_name>-<job id>.out``)."""
    command: list[str]
    nodes: int = 1
    ntasks_per_node: int = 1
    job_name: str = "redco"
    directory: str = "."
    partition: str | None = None
    time: str | None = None
    cpus_per_task: int | None = None
    gpus_per_node: int | None = None
    requeue: bool = False
    signal_before_s: int = 120
    extra: tuple[str, ...] = ()

    @property
    def script_path(self) -> str:
        return os.path.join(os.path.abspath(self.directory), f"{self.job_name}.sbatch")

    @property
    def output_pattern(self) -> str:
        return os.path.join(os.path.abspath(self.directory), f"{self.job_name}-%j.out")

    def output_path(self, job_id: str) -> str:
        return self.output_pattern.replace("%j", str(job_id))

    @property
    def n_tasks(self) -> int:
        return self.nodes * self.ntasks_per_node


def sbatch_options(job: SlurmJob) -> list[str]:
    """The ``#SBATCH`` options, in a fixed order: always-there ones first, then the optional."""
    options = [f"--job-name={job.job_name}", f"--nodes={job.nodes}",
               f"--ntasks-per-node={job.ntasks_per_node}", f"--output={job.output_pattern}",
               "--open-mode=append", f"--chdir={os.getcwd()}"]
    optional = {"partition": job.partition, "time": job.time,
                "cpus-per-task": job.cpus_per_task, "gpus-per-node": job.gpus_per_node}
    options += [f"--{name}={value}" for name, value in optional.items() if value]
    if job.requeue:  # SIGTERM to every task signal_before_s before the time limit; requeueable
        options += ["--requeue", f"--signal=TERM@{job.signal_before_s}"]
    return options + list(job.extra)


# With --requeue: a run told to stop (SIGTERM, from --signal before the time limit or from
# `scancel --signal=TERM`) saves a step checkpoint and exits 143; the job then requeues itself.
REQUEUE_ON_STOP = [
    "status=$?",
    "# 143: redco stopped on SIGTERM after writing a step checkpoint; run again, it resumes there.",
    'if [ "$status" -eq 143 ]; then scontrol requeue "$SLURM_JOB_ID"; fi',
    "exit $status"]


def sbatch_script(job: SlurmJob) -> str:
    """The text of the sbatch script: ``#SBATCH`` options, then the command under ``srun``."""
    if not job.command:
        raise LaunchError("no command: put it after `--`, e.g. `redco launch --launcher slurm "
                          "--nodes 2 -- python train.py`")
    if job.nodes < 1 or job.ntasks_per_node < 1:
        raise LaunchError(f"--nodes {job.nodes} --ntasks_per_node {job.ntasks_per_node}: both "
                          "must be at least 1")
    n, plural = job.n_tasks, lambda k: "s" * (k > 1)
    return "\n".join(["#!/bin/bash"] + [f"#SBATCH {o}" for o in sbatch_options(job)] + [
        "",
        f"# Written by `redco launch --launcher slurm`: {n} task{plural(n)} ({job.nodes} "
        f"node{plural(job.nodes)} x {job.ntasks_per_node}), each one JAX process.",
        "# redco-slurm's launcher finds each task's id, the process count and the coordinator",
        "# (the first node) in the SLURM_* variables of the srun step. If a task fails, srun",
        "# stops the others (--kill-on-bad-exit) and the job ends with its exit code.",
        "# Safe to run again: a requeued job (e.g. after preemption) appends to the same output",
        "# file (--open-mode=append) and redco resumes from the last step checkpoint.",
        f"srun --kill-on-bad-exit=1 {shlex.join(job.command)}",
        *(REQUEUE_ON_STOP if job.requeue else []),
        ""])


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise LaunchError(f"`{name}` is not on PATH: run this on a SLURM login node, or use "
                          "--dry_run to see the script.")
    return path


def submit(script_path: str) -> str:
    """Submit with ``sbatch --parsable``; return the job id."""
    out = subprocess.run([_tool("sbatch"), "--parsable", script_path], capture_output=True,
                         text=True)
    if out.returncode != 0:
        raise LaunchError(f"sbatch failed ({out.returncode}): {out.stderr.strip()}")
    return out.stdout.strip().split(";")[0]


def job_state(job_id: str) -> str | None:
    """The job's state from ``squeue`` (None once SLURM has forgotten the job)."""
    out = subprocess.run([_tool("squeue"), "-h", "-j", job_id, "-o", "%T", "--states=all"],
                         capture_output=True, text=True)
    state = out.stdout.strip().split("\n")[0].strip() if out.returncode == 0 else ""
    return state or None


def _accounting(job_id: str) -> dict[str, str]:
    """``JobState`` and ``ExitCode`` of a job from ``scontrol``, else ``sacct`` (may be empty)."""
    if shutil.which("scontrol"):
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                             text=True)
        if out.returncode == 0:
            return dict(re.findall(r"(\w+)=(\S+)", out.stdout))
    if shutil.which("sacct"):
        out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode"],
                             capture_output=True, text=True)
        if out.returncode == 0 and "|" in out.stdout:
            state, code = out.stdout.strip().split("\n")[0].split("|")[:2]
            return {"JobState": state.split()[0], "ExitCode": code}
    return {}


def job_exit_code(job_id: str) -> tuple[str | None, int | None]:
    """``(state, exit code)`` of an ended job; a job killed by signal ``s`` gives ``128 + s``, and
    one cancelled or timed out before any task failed gives 1."""
    fields = _accounting(job_id)
    if "ExitCode" not in fields:
        return fields.get("JobState"), None
    code_text, _, sig = fields["ExitCode"].partition(":")
    code = int(code_text) or (128 + int(sig) if sig and int(sig) else 0)
    if fields.get("JobState") not in (None, "COMPLETED") and code == 0:
        code = 1
    return fields.get("JobState"), code


class _Follower:
    """Copies what is appended to a file to ``out``, from where it last stopped."""

    def __init__(self, path: str, out: TextIO):
        self.path, self.out, self.offset, self.last = path, out, 0, b"\n"

    def copy(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        self.offset += len(chunk)
        if chunk:
            self.out.write(chunk.decode(errors="replace"))
            self.out.flush()
            self.last = chunk[-1:]

    def end_line(self) -> None:
        if self.last not in (b"\n", b""):
            self.out.write("\n")  # progress bars end lines with \r
            self.out.flush()


def ended_state(job_id: str) -> str | None:
    """The job's state once SLURM's controller says it has ended for good ("" if the controller
    has forgotten it and there is no accounting), else None. The controller is asked, not
    ``squeue``, which lags it: a job being requeued goes RUNNING -> COMPLETING -> PENDING without
    an ended state, and a query that a busy controller did not answer says nothing."""
    out = subprocess.run([_tool("scontrol"), "show", "job", "-o", job_id], capture_output=True,
                         text=True)
    if out.returncode == 0:
        state = dict(re.findall(r"(\w+)=(\S+)", out.stdout)).get("JobState")
        return state if state in DONE_STATES else None
    if "Invalid job id" in out.stderr:  # ended more than MinJobAge ago
        return _accounting(job_id).get("JobState", "")
    return None


def wait_for_job(job_id: str, output_path: str, poll_s: float = 1.0,
                 out: TextIO | None = None) -> int:
    """Follow the job until it has ended for good (``ended_state``), copying its output file to
    ``out`` (stdout) as it grows; return the job's exit code. Ctrl-C cancels the job."""
    follower = _Follower(output_path, out or sys.stdout)
    try:
        while (state := ended_state(job_id)) is None:
            follower.copy()
            time.sleep(poll_s)
    except KeyboardInterrupt:
        subprocess.run(["scancel", job_id])
        print(f"\nredco: cancelled job {job_id}", file=sys.stderr)
        return 130
    follower.copy()
    follower.end_line()
    final_state, code = job_exit_code(job_id)
    final_state = final_state or state or None
    if code is None:
        code = 0 if final_state == "COMPLETED" else 1
        if final_state is None:
            print(f"redco: job {job_id} is no longer known to SLURM and its exit code cannot be "
                  "read (no accounting); assuming failure", file=sys.stderr)
    print(f"redco: job {job_id} {final_state or 'ended'}, exit code {code} (output: "
          f"{output_path})", file=sys.stderr)
    return code


def launch_slurm(job: SlurmJob, dry_run: bool = False, wait: bool = False) -> int:
    """Print the script (``dry_run``), or write and submit it; with ``wait``, follow the job and
    return its exit code."""
    text = sbatch_script(job)
    if dry_run:
        print(text, end="")
        return 0
    os.makedirs(os.path.dirname(job.script_path), exist_ok=True)
    with open(job.script_path, "w") as f:
        f.write(text)
    print(f"redco: wrote {job.script_path}", flush=True)
    job_id = submit(job.script_path)
    output = job.output_path(job_id)
    print(f"redco: submitted job {job_id}; its output goes to {output}", flush=True)
    return wait_for_job(job_id, output) if wait else 0
