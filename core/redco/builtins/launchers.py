"""Built-in launchers, in the order ``Deployer`` tries them:

* ``slurm``: a task of an ``srun`` step with more than one task. JAX's own SLURM detection finds
  the process id (``SLURM_PROCID``), the count (``SLURM_NTASKS``) and the coordinator (the first
  node of ``SLURM_STEP_NODELIST``, port ``SLURM_JOB_ID % 4096 + 61440``).
* ``ip``: bare hosts named by address, port and process id, given to ``Deployer(n_processes=,
  host0_address=, host0_port=, process_id=)`` or in ``REDCO_N_PROCESSES``,
  ``REDCO_HOST0_ADDRESS``, ``REDCO_HOST0_PORT`` and ``REDCO_PROCESS_ID`` (what ``redco launch
  --launcher ip`` sets), so an unchanged script joins.
* ``local``: one process; the fallback.

Explicit ``Deployer`` arguments win over everything (``slurm`` stands aside when they are given),
then a SLURM step, then the ``REDCO_*`` variables, then ``local``. Each launcher also has
``explain(config) -> str``, the reason it does or does not apply (``redco doctor`` prints it).
Classic mistakes are refused before jax starts, with a message saying what to do.
"""
from __future__ import annotations

import ipaddress
import os
import socket

import jax

from redco.plugins import hookimpl

# A process that stops answering is declared lost after this many seconds (jax's default is
# 100); the survivors then stop too, instead of waiting in a collective.
HEARTBEAT_TIMEOUT_S = int(os.environ.get("REDCO_HEARTBEAT_TIMEOUT", 20))

# Deployer argument -> the environment variable the ``ip`` launcher reads it from.
IP_ENV = {"n_processes": "REDCO_N_PROCESSES", "host0_address": "REDCO_HOST0_ADDRESS",
          "host0_port": "REDCO_HOST0_PORT", "process_id": "REDCO_PROCESS_ID"}
# The hosts of the run, one entry per process ("a,b"); set by ``redco launch --launcher ip``.
HOSTS_ENV = "REDCO_HOSTS"
PROCESS_ARGS = ("n_processes", "host0_address", "host0_port", "process_id")


def check_port_free(port: int) -> None:
    """Process 0 serves the coordinator on ``port``: refuse a busy one before jax hangs on it."""
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError as e:
            raise RuntimeError(
                f"host0_port={port} is already in use on this host ({e.strerror}): is another "
                "run still going? Stop it, or give every process another host0_port.") from e


# ---- hosts -----------------------------------------------------------------------------------
def _addresses(host: str) -> list[str]:
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(host, None)})
    except (socket.gaierror, UnicodeError):
        return []


def is_loopback(host: str) -> bool:
    """Does ``host`` resolve to a loopback address (127.0.0.0/8, ::1) only?"""
    addresses = _addresses(host)
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback
                                   for a in addresses)


def is_local_host(host: str) -> bool:
    """Is ``host`` this machine: ``localhost``, its name, or an address bound here?"""
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    for address in _addresses(host):
        ip = ipaddress.ip_address(address.split("%")[0])
        if ip.is_loopback:
            return True
        family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
        with socket.socket(family) as s:  # only an address of this machine can be bound
            try:
                s.bind((address, 0))
                return True
            except OSError:
                pass
    return False


def check_hosts(host0_address: str, n_processes: int, hosts: list[str]) -> None:
    """Refuse a host list that cannot work: host 0 on loopback while other hosts are remote,
    or a list whose length is not the number of processes."""
    if hosts and len(hosts) != n_processes:
        raise ValueError(
            f"{HOSTS_ENV} names {len(hosts)} hosts ({','.join(hosts)}) but n_processes="
            f"{n_processes}: give one entry per process (repeat a host to run several processes "
            "on it).")
    remote = [h for h in hosts if not is_local_host(h)]
    if n_processes > 1 and remote and is_loopback(host0_address):
        raise ValueError(
            f"host0_address={host0_address!r} resolves to loopback ({_addresses(host0_address)[0]}"
            f"), which the processes on {', '.join(sorted(set(remote)))} cannot reach: give host "
            "0's address on the network (e.g. its IP from `hostname -I`) instead.")


# ---- ip ----------------------------------------------------------------------------------------
def _int(name: str, value) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} is not an integer.") from None


def ip_settings(config: dict) -> dict:
    """The ``ip`` launcher's settings: the ``Deployer`` arguments, each missing one read from its
    ``REDCO_*`` variable. An argument and a variable that disagree are an error."""
    settings = {}
    for key, var in IP_ENV.items():
        given, env = config.get(key), os.environ.get(var) or None
        if key != "host0_address":
            given = None if given is None else _int(key, given)
            env = None if env is None else _int(var, env)
        if given is not None and env is not None and given != env:
            raise ValueError(
                f"Deployer({key}={given!r}) disagrees with {var}={env!r} in the environment: "
                f"unset {var} or drop the argument, so that every process agrees.")
        settings[key] = given if given is not None else env
    return settings


def check_process_count(n_processes: int, process_id: int, source: str) -> None:
    if n_processes < 1:
        raise ValueError(f"n_processes={n_processes} ({source}) must be at least 1.")
    if not 0 <= process_id < n_processes:
        raise ValueError(
            f"process_id={process_id} but n_processes={n_processes} ({source}): ids run from 0 "
            f"to {n_processes - 1}, one per process. Is the process count the same on every "
            "host?")


class IPLauncher:
    """Hosts reached by IP: ``Deployer(n_processes=, host0_address=, host0_port=, process_id=)``,
    or the same in ``REDCO_N_PROCESSES``, ``REDCO_HOST0_ADDRESS``, ``REDCO_HOST0_PORT`` and
    ``REDCO_PROCESS_ID``."""

    def detect(self, config: dict) -> bool:
        n = config.get("n_processes")
        if n is None:
            n = os.environ.get(IP_ENV["n_processes"]) or None
        return n is not None and str(n).strip() != "1"

    def explain(self, config: dict) -> str:
        if config.get("n_processes") not in (None, 1):
            return f"Deployer(n_processes={config['n_processes']}) was given"
        env = {v: os.environ[v] for v in IP_ENV.values() if os.environ.get(v)}
        if env.get(IP_ENV["n_processes"], "1") != "1":
            return "from the environment: " + " ".join(f"{k}={v}" for k, v in env.items())
        return "no n_processes argument and no REDCO_N_PROCESSES > 1"

    def initialize(self, config: dict) -> None:
        s = ip_settings(config)
        missing = [k for k in ("host0_address", "host0_port", "process_id") if s[k] is None]
        if missing:
            raise ValueError(
                f"n_processes={s['n_processes']} needs {missing} as well (Deployer arguments, or "
                f"{', '.join(IP_ENV[k] for k in missing)}): every process must know host 0's "
                "address and port, and its own id.")
        check_process_count(s["n_processes"], s["process_id"], "ip launcher")
        if not 0 < s["host0_port"] < 65536:
            raise ValueError(f"host0_port={s['host0_port']} is not a TCP port (1-65535).")
        hosts = [h.strip() for h in os.environ.get(HOSTS_ENV, "").split(",") if h.strip()]
        check_hosts(s["host0_address"], s["n_processes"], hosts)
        if s["process_id"] == 0:
            check_port_free(s["host0_port"])
        local = config.get("n_local_devices")
        jax.distributed.initialize(
            coordinator_address=f"{s['host0_address']}:{s['host0_port']}",
            num_processes=s["n_processes"], process_id=s["process_id"],
            local_device_ids=list(range(local)) if local else None,
            heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S)


# ---- slurm -------------------------------------------------------------------------------------
def _slurm_ntasks() -> int:
    for var in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 1


def _in_step() -> bool:
    return "SLURM_STEP_ID" in os.environ or "SLURM_STEPID" in os.environ \
        or "SLURM_STEP_NODELIST" in os.environ


def _tasks_on_this_node() -> int | None:
    """How many tasks of this step run on this node (``SLURM_STEP_TASKS_PER_NODE`` reads like
    ``2(x3),1``, one entry per node, in ``SLURM_NODEID`` order)."""
    spec, node = os.environ.get("SLURM_STEP_TASKS_PER_NODE"), os.environ.get("SLURM_NODEID")
    if not spec or node is None or not node.isdigit():
        return None
    counts = []
    for part in spec.split(","):
        n, _, repeat = part.partition("(x")
        counts += [int(n)] * (int(repeat.rstrip(")")) if repeat else 1)
    return counts[int(node)] if int(node) < len(counts) else None


def slurm_coordinator() -> str:
    """The coordinator JAX derives from the SLURM variables (first node of the step, port
    ``SLURM_JOB_ID % 4096 + 61440`` unless ``JAX_COORDINATOR_PORT`` is set)."""
    try:
        from jax._src.clusters import SlurmCluster
        return SlurmCluster.get_coordinator_address(
            timeout_secs=None, override_coordinator_port=os.environ.get("JAX_COORDINATOR_PORT"))
    except Exception:  # noqa: BLE001 - only used to explain
        return "?"


class SlurmLauncher:
    """A task of an ``srun`` step with more than one task; JAX's SLURM detection does the rest."""

    def detect(self, config: dict) -> bool:
        if any(config.get(k) is not None for k in PROCESS_ARGS):
            return False  # explicit Deployer arguments win
        if "SLURM_JOB_ID" not in os.environ or _slurm_ntasks() < 2:
            return False
        # In the bare body of an sbatch script the REDCO_* variables of `redco launch --launcher
        # ip` win; without them, initialize() says to run through srun.
        return _in_step() or not os.environ.get(IP_ENV["n_processes"])

    def explain(self, config: dict) -> str:
        if any(config.get(k) is not None for k in PROCESS_ARGS):
            return "Deployer process arguments were given"
        if "SLURM_JOB_ID" not in os.environ:
            return "not in a SLURM job (no SLURM_JOB_ID)"
        job, n = os.environ["SLURM_JOB_ID"], _slurm_ntasks()
        if n < 2:
            return f"SLURM job {job} with {n} task"
        if not _in_step():
            return (f"SLURM job {job} with {n} tasks, but this is the batch script itself, not "
                    "a task of an srun step")
        return (f"task {os.environ.get('SLURM_PROCID')} of {n} of step "
                f"{os.environ.get('SLURM_STEP_ID', os.environ.get('SLURM_STEPID'))} of SLURM job "
                f"{job} on {os.environ.get('SLURM_STEP_NODELIST')}; coordinator "
                f"{slurm_coordinator()}")

    def initialize(self, config: dict) -> None:
        n = _slurm_ntasks()
        if not _in_step():
            raise RuntimeError(
                f"This is the body of the sbatch script of SLURM job "
                f"{os.environ.get('SLURM_JOB_ID')} ({n} tasks), not a task of a job step, so "
                "there is nothing to join: run the command through srun (`srun python "
                "train.py ...` in the script), or let `redco launch --launcher slurm ... -- "
                "python train.py ...` write and submit the script.")
        missing = [v for v in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NODELIST")
                   if v not in os.environ]
        if missing:
            raise RuntimeError(f"SLURM step without {', '.join(missing)}: cannot find this "
                               "task's id or the coordinator.")
        check_process_count(n, _int("SLURM_PROCID", os.environ["SLURM_PROCID"]), "SLURM")
        local = config.get("n_local_devices")
        if local:
            device_ids = list(range(local))
        elif _tasks_on_this_node() == 1:
            device_ids = []  # one task per node: all of its devices (jax would keep one GPU)
        else:
            device_ids = None  # several tasks per node: jax's default, device SLURM_LOCALID
        jax.distributed.initialize(cluster_detection_method="slurm",
                                   local_device_ids=device_ids,
                                   heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S)


# ---- local -------------------------------------------------------------------------------------
class LocalLauncher:
    """A single process: nothing to join."""

    def detect(self, config: dict) -> bool:
        return True

    def explain(self, config: dict) -> str:
        return "one process (the fallback)"

    def initialize(self, config: dict) -> None:
        pass


@hookimpl(trylast=True)
def register_launchers(register):
    register("slurm", SlurmLauncher())
    register("ip", IPLauncher())
    register("local", LocalLauncher())
