#!/usr/bin/env bash
# A single-node Slurm cluster on this machine, for the tests marked `slurm` (tests/test_slurm.py).
#
#   scripts/ci/slurm_up.sh      # install if needed, start munged, slurmctld, slurmd; wait for idle
#   scripts/ci/slurm_down.sh    # stop exactly the daemons this script started
#
# Needs root and Debian's packages (`apt-get install -y slurm-wlm munge`, installed here when
# missing). Everything the cluster writes lives in SLURM_CI_DIR (default /tmp/gndpo-slurm):
# slurm.conf, cgroup.conf, the munge socket, state and spool directories, logs and pid files.
# Nothing under /etc is changed, and a system munged or Slurm keeps running untouched: clients
# reach this cluster only with SLURM_CONF=$SLURM_CI_DIR/slurm.conf (the tests set it).
#
# Idempotent: when the three daemons of an earlier call are alive and the node is idle, it says
# so and returns. Measured facts behind the configuration: the project's REAL_ENGINES notes
# (Debian 12, slurm-wlm 22.05).
#
# Environment:
#   SLURM_CI_DIR    state directory (default /tmp/gndpo-slurm)
#   SLURM_CI_PORT   slurmctld port; slurmd uses the next one (default 6817)
#   SLURM_CI_WAIT   seconds to wait for the node to become idle (default 60)
set -euo pipefail

DIR=${SLURM_CI_DIR:-/tmp/gndpo-slurm}
PORT=${SLURM_CI_PORT:-6817}
WAIT=${SLURM_CI_WAIT:-60}
CONF=$DIR/slurm.conf
export SLURM_CONF=$CONF

log() { printf '[slurm_up] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

alive() {  # alive NAME: the daemon NAME started from this directory is running
  local pid
  pid=$(cat "$DIR/$1.pid" 2>/dev/null) || return 1
  [[ $pid =~ ^[0-9]+$ ]] && [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$1" ]]
}

node_state() { sinfo --noheader --nodes="$NODE" --format=%T 2>/dev/null | head -n 1; }

wait_idle() {
  local deadline=$((SECONDS + WAIT)) state=
  while ((SECONDS < deadline)); do
    state=$(node_state)
    # "idle", or "mixed"/"allocated" when an earlier call's cluster is running jobs: up either way
    if [[ $state == idle || $state == mixed || $state == allocated ]]; then
      log "node $NODE is $state; export SLURM_CONF=$CONF to use this cluster"
      return 0
    fi
    sleep 1
  done
  die "node $NODE is not idle after ${WAIT}s (sinfo says '${state:-nothing}'); see $DIR/log/"
}

NODE=$(hostname -s)

if alive munged && alive slurmctld && alive slurmd; then
  log "already up (pids in $DIR)"
  wait_idle
  exit 0
fi

[[ $(id -u) == 0 ]] || die "needs root: this cluster's daemons run as root (SlurmUser=root)"
apt_install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >&2; }
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
  || ! command -v munged >/dev/null; then
  command -v apt-get >/dev/null \
    || die "Slurm is not installed and there is no apt-get: install slurm-wlm and munge"
  log "installing slurm-wlm and munge with apt-get (about 2 minutes)"
  apt_install || { apt-get update -q >&2 && apt_install; } || die "apt-get install slurm-wlm munge failed"
fi

# A half-started cluster of an earlier call (one daemon died): stop what is left, start afresh.
"$(dirname "$0")/slurm_down.sh"

mkdir -p "$DIR"/{state,spool,log,munge}
chmod 700 "$DIR/munge"  # munged refuses a socket directory that others may write to
KEY=/etc/munge/munge.key
if [[ ! -r $KEY ]]; then  # the package creates one; make our own if it did not
  KEY=$DIR/munge/munge.key
  [[ -f $KEY ]] || { dd if=/dev/urandom of="$KEY" bs=1024 count=1 status=none && chmod 400 "$KEY"; }
fi

# The node exactly as slurmd sees it (CPUs, sockets, cores, threads, memory): a node configured
# with more than it has is drained at registration.
hardware=$(slurmd -C | head -n 1)
[[ $hardware == NodeName=* ]] || die "slurmd -C printed '$hardware', not a node description"

cat >"$CONF" <<EOF
# Written by scripts/ci/slurm_up.sh: a single-node cluster for the tests; everything under $DIR.
ClusterName=gndpo-ci
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
AuthType=auth/munge
# cred_expire: a requeued job waits this long before it starts again (Slurm default 120 s).
AuthInfo=socket=$DIR/munge/munge.socket,cred_expire=15
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
# No cgroups here: processes are tracked through /proc, tasks are not bound.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# Requeue is what the tests exercise; a node that was down returns by itself.
JobRequeue=1
ReturnToService=2
# No accounting database: finished jobs stay visible to scontrol for MinJobAge seconds, and every
# end of a job (requeues included) is one line of the job completion log.
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.txt
MinJobAge=600
# Shorter than Slurm's defaults, for the tests' timing. KillWait (30 s by default) is how long a
# cancelled or requeued job's processes have between SIGTERM and SIGKILL: 5 s makes a requeue a
# hard kill for the tiny trainer too, as it is on a cluster for a model whose step and save take
# longer than that. A pending job is scheduled within 5 s (60 s and 30 s by default).
KillWait=5
SchedulerParameters=sched_interval=5,bf_interval=5
$hardware State=UNKNOWN
PartitionName=ci Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
# 22.05 reads cgroup.conf even without cgroup plugins; "disabled" is not a plugin there.
cat >"$DIR/cgroup.conf" <<EOF
CgroupPlugin=autodetect
IgnoreSystemd=yes
EOF

log "starting munged, slurmctld and slurmd (config $CONF)"
munged --force --socket="$DIR/munge/munge.socket" --key-file="$KEY" \
  --pid-file="$DIR/munged.pid" --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed"
# Each pid file is named after its daemon: alive() above and slurm_down.sh read them.
slurmctld -c -f "$CONF"  # -c: no jobs recovered from an earlier cluster in this directory
slurmd -f "$CONF"

deadline=$((SECONDS + 10))
until alive munged && alive slurmctld && alive slurmd; do
  ((SECONDS < deadline)) || die "a daemon did not start: see munged.log, slurmctld.log, slurmd.log in $DIR/log"
  sleep 0.2
done
wait_idle
