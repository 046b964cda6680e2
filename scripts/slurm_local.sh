#!/usr/bin/env bash
# A single-node Slurm cluster in a temp dir, for trying and testing deploy/slurm/train.sbatch.
#
#   eval "$(scripts/slurm_local.sh up [DIR])"   # starts munged, slurmctld, slurmd; prints
#                                              # "export SLURM_CONF=DIR/slurm.conf"
#   sbatch deploy/slurm/train.sbatch …
#   scripts/slurm_local.sh down DIR             # stops the three daemons by PID
#
# Needs Debian's slurm-wlm and munge (apt-get install -y slurm-wlm munge; Slurm 22.05)
# and root (the daemons and jobs run as the calling user). The cluster: this host, all
# of its CPUs, select/cons_tres, proctrack/linuxproc, task/affinity, RequeueExit=75,76
# (elastictrain's "preempted, resume me" requeues the job), KillWait=30 (Slurm's
# default: SIGTERM -> SIGKILL; train.sbatch keeps its grace below it), and a job
# credential lifetime of 10 s instead of 120 s (AuthInfo cred_expire): a requeued job is
# held that long (+1 s) before it may start again (docs/deploy.md); the schedulers look
# at pending jobs every second (default: 30 s backfill, 60 s main loop), so it then starts.
set -euo pipefail

# The requeue hold; Slurm's minimum is 5 s, and a step must launch within it.
CRED_EXPIRE_S=10

die() { echo "slurm_local.sh: $*" >&2; exit 1; }

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...: poll a condition, fail at the deadline
    local deadline=$((SECONDS + $1)) what=$2
    shift 2
    until "$@" >/dev/null 2>&1; do
        [ "$SECONDS" -lt "$deadline" ] || die "timed out waiting for $what"
        sleep 0.2
    done
}

up() {
    local dir=${1:-$(mktemp -d -t slurm-local-XXXXXX)}
    for bin in munged slurmctld slurmd sbatch scontrol; do
        command -v "$bin" >/dev/null || die "$bin not found; fix: apt-get install -y slurm-wlm munge"
    done
    mkdir -p "$dir"/{state,spool,log,munge}
    chmod 700 "$dir/munge"
    local host cpus user
    host=$(hostname -s)
    cpus=$(nproc --all)
    user=$(id -un)

    dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
    chmod 400 "$dir/munge/munge.key"
    munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.sock" \
        --pid-file="$dir/munge/munged.pid" --log-file="$dir/log/munged.log" \
        --seed-file="$dir/munge/munged.seed"
    wait_for 10 munged test -S "$dir/munge/munge.sock"

    cat >"$dir/slurm.conf" <<EOF
ClusterName=local
SlurmctldHost=$host
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=$user
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.sock,cred_expire=$CRED_EXPIRE_S
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=1
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
JobRequeue=1
RequeueExit=75,76
KillWait=30
MinJobAge=3600
NodeName=$host CPUs=$cpus State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
    slurmctld -f "$dir/slurm.conf"
    slurmd -f "$dir/slurm.conf"
    export SLURM_CONF=$dir/slurm.conf
    wait_for 30 "node $host idle" sh -c "sinfo -h -n $host -o %t | grep -q idle"
    echo "export SLURM_CONF=$dir/slurm.conf"
}

down() {
    local dir=${1:?usage: slurm_local.sh down DIR}
    local pidfile pid
    for pidfile in "$dir/slurmd.pid" "$dir/slurmctld.pid" "$dir/munge/munged.pid"; do
        [ -s "$pidfile" ] || continue
        pid=$(cat "$pidfile")
        kill "$pid" 2>/dev/null || continue
        wait_for 30 "pid $pid to exit" sh -c "! kill -0 $pid"
    done
}

case "${1:-}" in
    up) up "${2:-}" ;;
    down) down "${2:-}" ;;
    *) die "usage: slurm_local.sh up [DIR] | down DIR" ;;
esac
