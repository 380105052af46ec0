"""``redco launch`` and ``redco doctor``: start an unchanged training script on several processes,
and see how a process would join a run.

* ``--launcher slurm`` writes an sbatch script whose body runs the command under ``srun`` (each
  task one JAX process, found by the ``slurm`` launcher) and submits it; ``--wait`` polls
  ``squeue`` until the job ends, streams its output file and exits with the job's exit code.
* ``--launcher ip`` prints one command line per host with the ``REDCO_*`` variables the ``ip``
  launcher reads; ``--run`` starts them here when every host is this machine.
* ``--launcher xmanager`` runs the processes as one XManager work unit (``redco.xmanager_launch``).
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

# Job states after which a SLURM job never runs again.
SLURM_DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
              "PREEMPTED", "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT", "REVOKED"}


class LaunchError(Exception):
    """A launch that cannot work, with what to do instead; the CLI prints it and exits 2."""


# ---- slurm -----------------------------------------------------------------------------------
@dataclass
class SlurmJob:
    command: list[str]
    nodes: int = 1
    ntasks_per_node: int = 1
    job_name: str = "redco"
    directory: str = "."
    partition: str | None = None
    time: str | None = None
    cpus_per_task: int | None = None
    gpus_per_node: int | None = None
    extra: tuple[str, ...] = ()

    @property
    def script_path(self) -> str:
        return os.path.join(os.path.abspath(self.directory), f"{self.job_name}.sbatch")

    @property
    def output_pattern(self) -> str:
        return os.path.join(os.path.abspath(self.directory), f"{self.job_name}-%j.out")

    def output_path(self, job_id: str) -> str:
        return self.output_pattern.replace("%j", str(job_id))


def sbatch_script(job: SlurmJob) -> str:
    """The text of the sbatch script: ``#SBATCH`` options, then the command under ``srun``."""
    if not job.command:
        raise LaunchError("no command: put it after `--`, e.g. `redco launch --launcher slurm "
                          "--nodes 2 -- python train.py`")
    if job.nodes < 1 or job.ntasks_per_node < 1:
        raise LaunchError(f"--nodes {job.nodes} --ntasks-per-node {job.ntasks_per_node}: both "
                          "must be at least 1")
    options = [f"--job-name={job.job_name}", f"--nodes={job.nodes}",
               f"--ntasks-per-node={job.ntasks_per_node}",
               f"--output={job.output_pattern}",
               f"--chdir={os.getcwd()}"]
    if job.partition:
        options.append(f"--partition={job.partition}")
    if job.time:
        options.append(f"--time={job.time}")
    if job.cpus_per_task:
        options.append(f"--cpus-per-task={job.cpus_per_task}")
    if job.gpus_per_node:
        options.append(f"--gpus-per-node={job.gpus_per_node}")
    options += list(job.extra)
    n = job.nodes * job.ntasks_per_node
    lines = ["#!/bin/bash"] + [f"#SBATCH {o}" for o in options] + [
        "",
        f"# Written by `redco launch --launcher slurm`: {n} task{'s' * (n > 1)} "
        f"({job.nodes} node{'s' * (job.nodes > 1)} x {job.ntasks_per_node}), each one JAX process.",
        "# redco's slurm launcher finds each task's id, the process count and the coordinator",
        "# (the first node) in the SLURM_* variables of the srun step. If a task fails, srun",
        "# stops the others (--kill-on-bad-exit) and the job ends with its exit code.",
        f"srun --kill-on-bad-exit=1 {shlex.join(job.command)}",
        ""]
    return "\n".join(lines)


def _slurm_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise LaunchError(f"`{name}` is not on PATH: run this on a SLURM login node, or use "
                          "--dry-run to see the script.")
    return path


def submit(script_path: str) -> str:
    """Submit with ``sbatch --parsable``; return the job id."""
    out = subprocess.run([_slurm_tool("sbatch"), "--parsable", script_path],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise LaunchError(f"sbatch failed ({out.returncode}): {out.stderr.strip()}")
    return out.stdout.strip().split(";")[0]


def job_state(job_id: str) -> str | None:
    """The job's state from ``squeue`` (None once SLURM has forgotten the job)."""
    out = subprocess.run([_slurm_tool("squeue"), "-h", "-j", job_id, "-o", "%T", "--states=all"],
                         capture_output=True, text=True)
    state = out.stdout.strip().split("\n")[0].strip() if out.returncode == 0 else ""
    return state or None


def job_exit_code(job_id: str) -> tuple[str | None, int | None]:
    """``(state, exit code)`` of an ended job, from ``scontrol`` (or ``sacct``); a job killed by
    signal ``s`` gives ``128 + s``."""
    fields = {}
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                         text=True) if shutil.which("scontrol") else None
    if out is not None and out.returncode == 0:
        fields = dict(re.findall(r"(\w+)=(\S+)", out.stdout))
    elif shutil.which("sacct"):
        out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode"],
                             capture_output=True, text=True)
        if out.returncode == 0 and "|" in out.stdout:
            state, code = out.stdout.strip().split("\n")[0].split("|")[:2]
            fields = {"JobState": state.split()[0], "ExitCode": code}
    if "ExitCode" not in fields:
        return fields.get("JobState"), None
    code, _, sig = fields["ExitCode"].partition(":")
    code = int(code) if int(code) else (128 + int(sig) if sig and int(sig) else 0)
    if fields.get("JobState") not in (None, "COMPLETED") and code == 0:
        code = 1  # cancelled or timed out before any task failed
    return fields.get("JobState"), code


def wait_for_job(job_id: str, output_path: str, poll_s: float = 1.0, out=None) -> int:
    """Poll ``squeue`` until the job ends, copying its output file to ``out`` as it grows;
    return the job's exit code. Ctrl-C cancels the job."""
    out = out or sys.stdout
    offset, state, last = 0, None, b"\n"

    def copy_output() -> None:
        nonlocal offset, last
        try:
            with open(output_path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        offset += len(chunk)
        if chunk:
            out.write(chunk.decode(errors="replace"))
            out.flush()
            last = chunk[-1:]

    try:
        while True:
            state = job_state(job_id)
            copy_output()
            if state is None or state.split()[0] in SLURM_DONE:
                break
            time.sleep(poll_s)
    except KeyboardInterrupt:
        subprocess.run(["scancel", job_id])
        print(f"\nredco: cancelled job {job_id}", file=sys.stderr)
        return 130
    time.sleep(0.2)  # the last lines may land just after the state changes
    copy_output()
    if last not in (b"\n", b""):
        out.write("\n")  # progress bars end lines with \r
        out.flush()
    final_state, code = job_exit_code(job_id)
    final_state = final_state or state
    if code is None:
        code = 0 if final_state == "COMPLETED" else 1
        if final_state is None:
            print(f"redco: job {job_id} is no longer known to SLURM and its exit code cannot be "
                  "read (no accounting); assuming failure", file=sys.stderr)
    print(f"redco: job {job_id} {final_state or 'ended'}, exit code {code} (output: "
          f"{output_path})", file=sys.stderr)
    return code


def launch_slurm(job: SlurmJob, dry_run: bool = False, wait: bool = False) -> int:
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
    if not wait:
        return 0
    return wait_for_job(job_id, output)


# ---- ip --------------------------------------------------------------------------------------
def ip_commands(command: list[str], hosts: list[str], port: int,
                host0_address: str | None = None) -> list[tuple[str, dict, str]]:
    """``(host, env, command line)`` for each process: process ``i`` runs on ``hosts[i]``
    with the ``REDCO_*`` variables the ``ip`` launcher reads. Refuses a host list that cannot
    work (see ``redco.builtins.launchers.check_hosts``)."""
    from redco.builtins.launchers import HOSTS_ENV, IP_ENV, check_hosts
    if not command:
        raise LaunchError("no command: put it after `--`, e.g. `redco launch --launcher ip "
                          "--hosts a,b -- python train.py`")
    if not hosts:
        raise LaunchError("--hosts needs at least one host (repeat a host to run several "
                          "processes on it)")
    if not 0 < port < 65536:
        raise LaunchError(f"--port {port} is not a TCP port (1-65535)")
    host0 = host0_address or hosts[0]
    try:
        check_hosts(host0, len(hosts), hosts)
    except ValueError as e:
        raise LaunchError(str(e)) from None
    rows = []
    for i, host in enumerate(hosts):
        env = {HOSTS_ENV: ",".join(hosts), IP_ENV["n_processes"]: str(len(hosts)),
               IP_ENV["host0_address"]: host0, IP_ENV["host0_port"]: str(port),
               IP_ENV["process_id"]: str(i)}
        line = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(command)
        rows.append((host, env, line))
    return rows


def _pump(proc: subprocess.Popen, prefix: str) -> None:
    for line in proc.stdout:
        sys.stdout.write(prefix + line)
        sys.stdout.flush()


def run_local(rows: list[tuple[str, dict, str]], command: list[str]) -> int:
    """Run every process here, output prefixed ``[i]``; when one fails, stop the others (as
    ``srun --kill-on-bad-exit`` does) and return its exit code."""
    from redco.builtins.launchers import is_local_host
    remote = [host for host, _, _ in rows if not is_local_host(host)]
    if remote:
        remote = sorted(set(remote))
        raise LaunchError(f"--run starts processes on this machine only, and "
                          f"{', '.join(remote)} {'is' if len(remote) == 1 else 'are'} not this "
                          "machine: run the printed lines on their hosts (e.g. over ssh) "
                          "instead.")
    procs, pumps = [], []
    for i, (_, env, _) in enumerate(rows):
        p = subprocess.Popen(command, env={**os.environ, **env}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
        procs.append(p)
        pumps.append(threading.Thread(target=_pump, args=(p, f"[{i}] "), daemon=True))
        pumps[-1].start()
    failed = None
    try:
        while None in [p.poll() for p in procs]:  # poll every process, each time
            for i, p in enumerate(procs):
                if failed is None and p.returncode not in (None, 0):
                    failed = (i, p.returncode)
                    print(f"redco: process {i} exited with code {p.returncode}; stopping the "
                          "others", file=sys.stderr, flush=True)
                    for q in procs:
                        if q.poll() is None:
                            os.killpg(q.pid, signal.SIGTERM)
            time.sleep(0.1)
    except KeyboardInterrupt:
        for q in procs:
            if q.poll() is None:
                os.killpg(q.pid, signal.SIGTERM)
        for q in procs:
            q.wait()
        return 130
    for t in pumps:
        t.join(timeout=5)
    if failed is None:
        failed = next(((i, p.returncode) for i, p in enumerate(procs) if p.returncode), None)
    if failed is None:
        return 0
    code = failed[1]
    return code if code > 0 else 128 - code  # killed by signal s: 128 + s, as a shell says


def launch_ip(command: list[str], hosts: list[str], port: int, run: bool = False,
              host0_address: str | None = None) -> int:
    rows = ip_commands(command, hosts, port, host0_address)
    if not run:
        print(f"# {len(rows)} processes: run each line on its host (in any order; they wait "
              "for each other up to 5 minutes)")
        for i, (host, _, line) in enumerate(rows):
            print(f"# process {i} on {host}")
            print(line)
        return 0
    return run_local(rows, command)


# ---- doctor ----------------------------------------------------------------------------------
def doctor(launcher: str | None = None, n_local_devices: int | None = None) -> None:
    """Print which launcher this process would use and why, then join the run and print the
    devices, the process index and count, and the mesh of ``Deployer(n_model_shards=1)``."""
    import tempfile

    from redco import plugins
    launchers = plugins.registry("launchers")
    config = dict(n_processes=None, host0_address=None, host0_port=None, process_id=None,
                  n_local_devices=n_local_devices)
    chosen = launcher or next(name for name, ln in launchers.items() if ln.detect(config))
    print("launchers (tried in this order):")
    for name, ln in launchers.items():
        why = ln.explain(config) if hasattr(ln, "explain") else ""
        mark = "->" if name == chosen else "  "
        verdict = "given by --launcher" if name == launcher else (
            "detected" if ln.detect(config) else "not detected")
        print(f" {mark} {name:<8} {verdict}: {why}")
    print(f"launcher: {chosen}", flush=True)

    import jax

    from redco import Deployer
    with tempfile.TemporaryDirectory() as workdir:
        deployer = Deployer(jax_seed=0, n_model_shards=1, workdir=workdir, loggers=(),
                            verbose=False, launcher=launcher, n_local_devices=n_local_devices)
        devices = deployer.devices
        local = [d for d in devices if d.process_index == jax.process_index()]
        kinds = sorted({d.device_kind for d in devices})
        print(f"process: {jax.process_index()} of {jax.process_count()}")
        print(f"devices: {len(devices)} in all, {len(local)} here, platform "
              f"{devices[0].platform}, kind {', '.join(kinds)}")
        print(f"local devices: {[d.id for d in local]}")
        ids = [[d.id for d in row] for row in deployer.mesh.devices]
        shown = ids if len(ids) <= 16 else ids[:8] + ["..."] + ids[-4:]
        print(f"mesh of Deployer(n_model_shards=1): {dict(deployer.mesh.shape)}, device ids "
              f"by dp row: {shown}")
        deployer.close()
