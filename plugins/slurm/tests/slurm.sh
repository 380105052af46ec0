#!/usr/bin/env bash
# A real single-node SLURM cluster on this machine, for plugins/slurm/tests/test_slurm_cluster.py.
#
#   slurm.sh install   install Debian's slurm-wlm and munge with apt, if missing (needs root)
#   slurm.sh start     write $REDCO_SLURM_DIR/slurm.conf and start munged, slurmctld and slurmd
#   slurm.sh stop      stop the daemons this script started
#   slurm.sh env       print `export SLURM_CONF=...` for clients (sbatch, srun, squeue)
#
# The node is this host (its real name when it resolves, else localhost) and advertises 8 CPUs
# whatever it has (SlurmdParameters=config_overrides), so jobs of several tasks run on 2 cores.
# Everything lives under $REDCO_SLURM_DIR (default /tmp/redco-slurm) with its own ports
# ($REDCO_SLURM_PORT, default 6817, and the next one), so /etc/slurm is never touched.
set -euo pipefail

DIR=${REDCO_SLURM_DIR:-/tmp/redco-slurm}
PORT=${REDCO_SLURM_PORT:-6817}
CPUS=${REDCO_SLURM_CPUS:-8}
CONF=$DIR/slurm.conf

die() { echo "slurm.sh: $*" >&2; exit 1; }

have_all() { command -v sbatch >/dev/null && command -v slurmctld >/dev/null \
             && command -v slurmd >/dev/null && command -v munged >/dev/null; }

install() {
    if [ "${REDCO_SKIP_SLURM:-}" = 1 ]; then echo "slurm.sh: REDCO_SKIP_SLURM=1, not installing"; return 0; fi
    have_all && return 0
    [ "$(id -u)" = 0 ] || die "slurm-wlm and munge are not installed and this is not root: run \
'apt-get install slurm-wlm munge' as root (or set REDCO_SKIP_SLURM=1 to skip the SLURM test)"
    command -v apt-get >/dev/null || die "slurm-wlm and munge are not installed and there is no \
apt-get here: install SLURM and munge yourself (or set REDCO_SKIP_SLURM=1 to skip the SLURM test)"
    # DPkg::Lock::Timeout: wait for an apt run of another environment (`tox p`: chromium.sh).
    local apt=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends
               -o DPkg::Lock::Timeout=600 slurm-wlm munge)
    "${apt[@]}" >"${TMPDIR:-/tmp}/redco-slurm-apt.log" 2>&1 || {
        apt-get update -q >>"${TMPDIR:-/tmp}/redco-slurm-apt.log" 2>&1 || true
        "${apt[@]}" >>"${TMPDIR:-/tmp}/redco-slurm-apt.log" 2>&1
    } || die "apt-get install slurm-wlm munge failed: see ${TMPDIR:-/tmp}/redco-slurm-apt.log"
    have_all || die "apt-get installed slurm-wlm and munge but sbatch/slurmctld/slurmd/munged \
are still not on PATH"
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

node_name() {
    local host
    host=$(hostname -s 2>/dev/null || hostname)
    if getent hosts "$host" >/dev/null 2>&1; then echo "$host"; else echo localhost; fi
}

write_conf() {
    local node ctld
    node=$(node_name)
    ctld=$(hostname -s 2>/dev/null || hostname)
    mkdir -p "$DIR/state" "$DIR/spool" "$DIR/jobs"
    cat >"$CONF" <<EOF
# Written by plugins/slurm/tests/slurm.sh: one node, this host, controller and compute node at once.
ClusterName=redco
SlurmctldHost=$ctld(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
MinJobAge=600
SlurmdParameters=config_overrides
NodeName=$node NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    echo "$node" >"$DIR/node"
}

start_munge() {
    # One munged serves the whole machine: reuse a running one.
    if [ -S /run/munge/munge.socket.2 ] && pgrep -x munged >/dev/null; then return 0; fi
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
    [ -f /etc/munge/munge.key ] || { mungekey --create --keyfile /etc/munge/munge.key \
        && chown munge:munge /etc/munge/munge.key; }
    if id munge >/dev/null 2>&1; then
        runuser -u munge -- munged
    else
        munged --force
    fi
    touch "$DIR/munged.ours"
}

start() {
    have_all || die "SLURM is not installed: run '$0 install' first"
    [ "$(id -u)" = 0 ] || die "the SLURM daemons are started as root; this is uid $(id -u)"
    mkdir -p "$DIR"
    if alive "$DIR/slurmctld.pid" && alive "$DIR/slurmd.pid" \
            && SLURM_CONF=$CONF sinfo -h >/dev/null 2>&1; then
        echo "slurm.sh: already running ($CONF)"; return 0
    fi
    stop_daemons
    write_conf
    start_munge
    slurmctld -f "$CONF"
    local node
    node=$(cat "$DIR/node")
    if [ "$node" = localhost ]; then slurmd -f "$CONF" -N localhost; else slurmd -f "$CONF"; fi
    # Wait until the node is idle and a job could start.
    for _ in $(seq 1 150); do
        state=$(SLURM_CONF=$CONF sinfo -h -N -o %T 2>/dev/null || true)
        case "$state" in idle*) echo "slurm.sh: node $node idle ($CONF)"; return 0 ;; esac
        sleep 0.2
    done
    echo "slurm.sh: the node did not become idle (state: ${state:-none}); logs:" >&2
    tail -n 20 "$DIR/slurmctld.log" "$DIR/slurmd.log" >&2 || true
    exit 1
}

stop_daemons() {
    local pidfile pid
    for pidfile in "$DIR/slurmd.pid" "$DIR/slurmctld.pid"; do
        if alive "$pidfile"; then
            pid=$(cat "$pidfile")
            kill "$pid" 2>/dev/null || true
            for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -9 "$pid" 2>/dev/null || true
        fi
        rm -f "$pidfile"
    done
}

stop() {
    stop_daemons
    if [ -f "$DIR/munged.ours" ]; then
        [ -f /run/munge/munged.pid ] && kill "$(cat /run/munge/munged.pid)" 2>/dev/null || true
        rm -f "$DIR/munged.ours"
    fi
    echo "slurm.sh: stopped"
}

case "${1:-}" in
    install) install ;;
    start) start ;;
    stop) stop ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) die "usage: $0 install|start|stop|env" ;;
esac
