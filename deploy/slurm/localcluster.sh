#!/usr/bin/env bash
# A one-machine Slurm cluster for trying and testing `fedhop slurm` (tests/test_slurm.py uses it).
#
#   deploy/slurm/localcluster.sh start DIR   install slurm-wlm + munge if missing (apt-get, root),
#                                            write DIR/slurm.conf, start munged, slurmctld and
#                                            slurmd, wait until the node is idle, print
#                                            `export SLURM_CONF=DIR/slurm.conf`
#   deploy/slurm/localcluster.sh stop DIR    stop the daemons it started (by the PIDs in DIR/*.pid)
#
# Everything lives in DIR: the munge key and socket, the controller's state, the spool, the logs.
# The node is this machine (its short host name, its own CPU count or FEDHOP_SLURM_CPUS: see
# below); one partition, `local`, the default.  The daemons run as the caller, which must be root
# (slurmd starts the job steps as the submitting user).  Exit 3: Slurm could not be installed or started (a test skips).
set -euo pipefail

usage() { echo "usage: $0 start|stop DIR" >&2; exit 2; }
[ $# -eq 2 ] || usage
cmd=$1
dir=$(mkdir -p "$2" && cd "$2" && pwd)

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

stop_pid() {   # stop_pid NAME: TERM the PID in DIR/NAME.pid, KILL it after 10 s
    local f="$dir/$1.pid" pid
    [ -s "$f" ] || return 0
    pid=$(cat "$f")
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$f"
}

if [ "$cmd" = stop ]; then
    # this cluster's jobs first (their steps would outlive slurmd), then the daemons
    if [ -s "$dir/slurmctld.pid" ] && kill -0 "$(cat "$dir/slurmctld.pid")" 2>/dev/null; then
        export SLURM_CONF=$dir/slurm.conf
        scancel --user="$(id -un)" 2>/dev/null || true
        for _ in $(seq 150); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.2; done
    fi
    stop_pid slurmd; stop_pid slurmctld; stop_pid munged
    exit 0
fi
[ "$cmd" = start ] || usage

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        echo "localcluster: slurmctld/slurmd/munged are missing and cannot be installed here (needs root and apt-get)" >&2
        exit 3
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y --no-install-recommends slurm-wlm munge >/dev/null 2>&1 \
        || { apt-get update >/dev/null 2>&1 && apt-get install -y --no-install-recommends slurm-wlm munge >/dev/null 2>&1; } \
        || { echo "localcluster: apt-get install slurm-wlm munge failed" >&2; exit 3; }
fi
if [ "$(id -u)" != 0 ]; then
    echo "localcluster: the daemons must run as root (slurmd starts job steps as the submitting user)" >&2
    exit 3
fi

host=$(hostname -s)
# The node claims this machine's CPUs (FEDHOP_SLURM_CPUS=N claims N instead, through
# SlurmdParameters=config_overrides), so a job asks what a real node of that size gives it: more
# processes than CPUs need --overcommit.  The partition lets up to 4 jobs share each CPU
# (OverSubscribe=FORCE:4), so a few small runs (a handful of mostly idle processes each) run side by
# side instead of queueing.
cpus=${FEDHOP_SLURM_CPUS:-$(nproc)}
chmod 700 "$dir"
mkdir -p "$dir/state" "$dir/spool" "$dir/munge"
chmod 700 "$dir/munge"
[ -s "$dir/munge/munge.key" ] || { head -c 1024 /dev/urandom > "$dir/munge/munge.key"; chmod 400 "$dir/munge/munge.key"; }
cat > "$dir/slurm.conf" <<EOF
ClusterName=fedhoplocal
SlurmctldHost=$host
SlurmUser=root
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.socket
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.daemon.pid
SlurmdPidFile=$dir/slurmd.daemon.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
UnkillableStepTimeout=300
MinJobAge=30
SlurmdParameters=config_overrides
NodeName=$host CPUs=$cpus State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
export SLURM_CONF=$dir/slurm.conf

# each daemon in the foreground of a background job, so that $! is its PID
munged --foreground --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
    --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/munged.seed" \
    >/dev/null 2>&1 &
echo $! > "$dir/munged.pid"
for _ in $(seq 100); do [ -S "$dir/munge/munge.socket" ] && break; sleep 0.1; done
[ -S "$dir/munge/munge.socket" ] || { echo "localcluster: munged did not start (see $dir/munge/munged.log)" >&2; stop_pid munged; exit 3; }
slurmctld -D -i -f "$dir/slurm.conf" >>"$dir/slurmctld.log" 2>&1 &
echo $! > "$dir/slurmctld.pid"
slurmd -D -f "$dir/slurm.conf" >>"$dir/slurmd.log" 2>&1 &
echo $! > "$dir/slurmd.pid"
for _ in $(seq 300); do
    state=$(sinfo -h -N -o '%T' 2>/dev/null | head -1 || true)
    [ "$state" = idle ] && break
    sleep 0.1
done
if [ "$state" != idle ]; then
    echo "localcluster: the node did not become idle (state '${state:-none}'; see $dir/slurmctld.log, $dir/slurmd.log)" >&2
    stop_pid slurmd; stop_pid slurmctld; stop_pid munged
    exit 3
fi
echo "export SLURM_CONF=$dir/slurm.conf"
