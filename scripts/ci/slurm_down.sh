#!/usr/bin/env bash
# Stop the single-node Slurm cluster of scripts/ci/slurm_up.sh: its jobs first, then slurmd,
# slurmctld and munged, each by the pid in its pid file under SLURM_CI_DIR (default
# /tmp/gndpo-slurm). Nothing else is signalled. Safe to call when nothing is running.
set -euo pipefail

DIR=${SLURM_CI_DIR:-/tmp/gndpo-slurm}
export SLURM_CONF=$DIR/slurm.conf

log() { printf '[slurm_down] %s\n' "$*" >&2; }

pid_of() {  # pid_of NAME: the pid of the daemon NAME started from this directory, if alive
  local pid
  pid=$(cat "$DIR/$1.pid" 2>/dev/null) || return 1
  [[ $pid =~ ^[0-9]+$ && $(cat "/proc/$pid/comm" 2>/dev/null) == "$1" ]] || return 1
  echo "$pid"
}

# Jobs still running would leave their slurmstepd and tasks behind once slurmd is gone.
if pid_of slurmctld >/dev/null && [[ -n $(squeue --noheader --format=%i 2>/dev/null) ]]; then
  log "cancelling the jobs still in the queue"
  scancel --full --quiet "$(squeue --noheader --format=%i | paste -sd, -)" || true
  deadline=$((SECONDS + 40))  # KillWait (30 s) and some
  while [[ -n $(squeue --noheader --format=%i 2>/dev/null) ]] && ((SECONDS < deadline)); do
    sleep 1
  done
fi

for name in slurmd slurmctld munged; do
  pid=$(pid_of "$name") || { rm -f "$DIR/$name.pid"; continue; }
  log "stopping $name (pid $pid)"
  kill -TERM "$pid" 2>/dev/null || true
  deadline=$((SECONDS + 15))
  while [[ -e /proc/$pid ]] && ((SECONDS < deadline)); do sleep 0.2; done
  if [[ -e /proc/$pid ]]; then
    log "$name (pid $pid) did not stop within 15 s: SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$DIR/$name.pid"
done
