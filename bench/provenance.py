"""What every benchmark prints first, so a table can name the one run it came from: the commit
(``+dirty`` when tracked files differ from it), the exact command, and the machine."""
from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Flags with which a benchmark runs itself as a worker subprocess: workers print no header.
WORKER_FLAGS = {"--worker", "--row", "--side", "--old_side"}


def commit() -> str:
    """``git rev-parse --short HEAD`` of this repository, ``+dirty`` if tracked files changed."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True).stdout
    head = git("rev-parse", "--short=10", "HEAD").strip() or "unknown (not a git checkout)"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no").strip() else "")


def machine() -> str:
    """CPU, core count, Python, and (if jax is installed) the devices and jax/flax versions."""
    parts = [f"{platform.machine()} {platform.processor() or platform.system()}",
             f"{os.cpu_count()} cores", f"Python {platform.python_version()}"]
    try:
        import jax
        devices = jax.devices()
        parts += [f"{len(devices)} x {devices[0].device_kind} ({devices[0].platform})",
                  f"jax {jax.__version__}"]
        import flax
        parts.append(f"flax {flax.__version__}")
    except ImportError:
        pass
    return ", ".join(parts)


def print_provenance() -> None:
    """Print the run's commit, command and machine, unless this process is a worker."""
    if WORKER_FLAGS & set(sys.argv):
        return
    command = shlex.join([os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]])
    print(f"commit: {commit()}\ncommand: python {command}\nmachine: {machine()}\n", flush=True)
