"""``redco-ip``: multi-host runs. The ``ip`` launcher (this module), what every joining launcher
shares (``redco_ip.join``: the heartbeat timeout, the process-count checks), and ``redco doctor``
(``redco_ip.doctor``).

The ``ip`` launcher: hosts reached by address, joined by ``jax.distributed``.

Joining: ``Deployer(n_processes=, host0_address=, host0_port=, process_id=)`` (the paper's
arguments), or the same in ``REDCO_N_PROCESSES``, ``REDCO_HOST0_ADDRESS``, ``REDCO_HOST0_PORT``
and ``REDCO_PROCESS_ID``. Submitting: ``redco launch --launcher ip --hosts a,b -- cmd`` prints one
command line per process with those variables set, and ``--run`` starts them here, stopping the
others when one fails (as ``srun --kill-on-bad-exit`` does). Classic mistakes are refused before
jax starts: a busy port, a process id out of range, an argument that disagrees with its variable,
host 0 on loopback while other hosts are remote.

``redco`` depends on this distribution, so a bare ``pip install redco`` runs a multi-host script
written against the paper's arguments, and has ``redco doctor``. Launcher plugins that join runs
(``redco-slurm``) depend on it for ``redco_ip.join``.

Registered through the ``redco`` entry-point group: ``register_launchers`` (``"ip"``) and
``register_commands`` (``"doctor"``, ``trylast`` so that a plugin may replace it).
"""
from __future__ import annotations

import ipaddress
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

import jax

import redco
from redco.protocols import Launcher, LaunchError
from redco_ip.doctor import Doctor
from redco_ip.join import HEARTBEAT_TIMEOUT_S, as_int, check_process_count

# Deployer argument -> the environment variable the ``ip`` launcher reads it from.
IP_ENV = {"n_processes": "REDCO_N_PROCESSES", "host0_address": "REDCO_HOST0_ADDRESS",
          "host0_port": "REDCO_HOST0_PORT", "process_id": "REDCO_PROCESS_ID"}
# The hosts of the run, one entry per process ("a,b"); set by ``redco launch --launcher ip``.
HOSTS_ENV = "REDCO_HOSTS"


def check_port_free(port: int) -> None:
    """Process 0 serves the coordinator on ``port``: refuse a busy one before jax hangs on it."""
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError as e:
            raise RuntimeError(
                f"host0_port={port} is already in use on this host ({e.strerror}): is another "
                "run still going? Stop it, or give every process another host0_port.") from e


def check_joined(n_processes: int, process_id: int) -> None:
    """This process joined a run already (an earlier ``Deployer``): it must be the same one."""
    if (jax.process_count(), jax.process_index()) != (n_processes, process_id):
        raise RuntimeError(
            f"This process already joined a run as process {jax.process_index()} of "
            f"{jax.process_count()} (an earlier Deployer); n_processes={n_processes}, "
            f"process_id={process_id} asks for another. A process joins one run: give every "
            "Deployer of it the same settings.")


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
def ip_settings(config: dict) -> dict:
    """The ``ip`` launcher's settings: the ``Deployer`` arguments, each missing one read from its
    ``REDCO_*`` variable. An argument and a variable that disagree are an error."""
    settings = {}
    for key, var in IP_ENV.items():
        given, env = config.get(key), os.environ.get(var) or None
        if key != "host0_address":
            given = None if given is None else as_int(key, given)
            env = None if env is None else as_int(var, env)
        if given is not None and env is not None and given != env:
            raise ValueError(
                f"Deployer({key}={given!r}) disagrees with {var}={env!r} in the environment: "
                f"unset {var} or drop the argument, so that every process agrees.")
        settings[key] = given if given is not None else env
    return settings


class IPLauncher(Launcher):
    """Hosts reached by IP: ``Deployer(n_processes=, host0_address=, host0_port=, process_id=)``,
    or the same in ``REDCO_N_PROCESSES``, ``REDCO_HOST0_ADDRESS``, ``REDCO_HOST0_PORT`` and
    ``REDCO_PROCESS_ID``."""
    description = "one command line per host, with the REDCO_* variables the ip launcher reads"

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
        if jax.distributed.is_initialized():  # a Deployer before this one joined the run
            check_joined(s["n_processes"], s["process_id"])
            return
        if s["process_id"] == 0:
            check_port_free(s["host0_port"])
        local = config.get("n_local_devices")
        jax.distributed.initialize(
            coordinator_address=f"{s['host0_address']}:{s['host0_port']}",
            num_processes=s["n_processes"], process_id=s["process_id"],
            local_device_ids=list(range(local)) if local else None,
            heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S)

    def add_arguments(self, group) -> None:
        group.add_argument("--hosts", help="comma-separated, one entry per process; host 0 first")
        group.add_argument("--host0_address", "--host0-address", help="host 0's address as the "
                           "others reach it (default: the first host)")
        group.add_argument("--port", type=int, default=12355, help="host 0's coordinator port")
        group.add_argument("--run", dest="run_here", action="store_true",
                           help="run the processes here (every host must be this machine) and wait")

    def submit(self, command: list[str], args) -> int:
        if not args.hosts:
            raise LaunchError("--launcher ip needs --hosts a,b,... (one entry per process; repeat "
                              "a host to run several on it)")
        hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
        return launch_ip(command, hosts, args.port, run=args.run_here,
                         host0_address=args.host0_address)


# ---- ip: starting the processes -----------------------------------------------------------
def ip_commands(command: list[str], hosts: list[str], port: int,
                host0_address: str | None = None) -> list[tuple[str, dict, str]]:
    """``(host, env, command line)`` for each process: process ``i`` runs on ``hosts[i]``
    with the ``REDCO_*`` variables the ``ip`` launcher reads. Refuses a host list that cannot
    work (see ``redco.builtins.launchers.check_hosts``)."""
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


@redco.hookimpl
def register_launchers(register):
    register("ip", IPLauncher())


@redco.hookimpl(trylast=True)
def register_commands(register):
    register("doctor", Doctor())
