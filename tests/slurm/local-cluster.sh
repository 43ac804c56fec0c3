#!/usr/bin/env bash
# Starts a one-node Slurm cluster on this machine (munged, slurmctld, slurmd from Debian's
# slurmd/slurmctld/slurm-client/munge packages), so that the README's srun lines run as
# typed. Run as root. Prints, as its last line, the SLURM_CONF to export.
#
#   export SLURM_CONF=$(bash tests/slurm/local-cluster.sh | tail -n1)
#   bash tests/slurm/local-cluster.sh stop
#
# State lives in ${DSPARK_SLURM_DIR:-/tmp/dspark-slurm}. Idempotent: a cluster that already
# answers is reused.
set -euo pipefail
dir="${DSPARK_SLURM_DIR:-/tmp/dspark-slurm}"
conf="$dir/slurm.conf"
log() { echo "[slurm] $*" >&2; }

stop() {
    for p in slurmd slurmctld; do
        [ -f "$dir/$p.pid" ] && kill "$(cat "$dir/$p.pid")" 2>/dev/null || true
    done
}
if [ "${1:-}" = stop ]; then stop; exit 0; fi

for b in munged slurmctld slurmd srun scontrol sinfo; do
    command -v "$b" >/dev/null || { log "$b not found (apt-get install slurmd slurmctld slurm-client munge)"; exit 1; }
done
if SLURM_CONF="$conf" timeout 5 sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
    log "reusing the cluster of $conf"
    echo "$conf"
    exit 0
fi
stop
mkdir -p "$dir"/{spool,state} /run/munge
chown slurm "$dir/state"
if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge/munge.key /run/munge; chmod 400 /etc/munge/munge.key
pgrep -x munged >/dev/null || su -s /bin/sh munge -c "/usr/sbin/munged --force" \
    || /usr/sbin/munged --force
node=$(hostname -s)
cpus=$(nproc)
mem=$(awk '/MemTotal/ {print int($2/1024) - 512}' /proc/meminfo)
cat >"$conf" <<CONF
ClusterName=dspark-test
SlurmctldHost=$node
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
NodeName=$node CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=test Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
CONF
SLURM_CONF="$conf" /usr/sbin/slurmctld
SLURM_CONF="$conf" /usr/sbin/slurmd
for _ in $(seq 1 60); do
    if SLURM_CONF="$conf" sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed)'; then
        log "one-node cluster up ($node, $cpus CPUs)"
        echo "$conf"
        exit 0
    fi
    sleep 0.5
done
log "the cluster did not come up; logs:"
tail -n 20 "$dir/slurmctld.log" "$dir/slurmd.log" >&2 || true
exit 1
