#!/usr/bin/env bash
# A one-node Slurm cluster on this machine (slurmctld + slurmd + munge on localhost), for
# trying `tokpack ... --executor slurm` and for the executor tests.
#
#   scripts/slurm-local.sh start    install if missing, configure, start, wait until the node is idle
#   scripts/slurm-local.sh status   daemons, node state, queue
#   scripts/slurm-local.sh stop     stop slurmd, slurmctld and munged
#
# Needs root (or passwordless sudo) for apt-get and the daemons. Idempotent: `start` on a running
# cluster only checks it. No cgroups (containers often cannot delegate them): processes are tracked
# with proctrack/linuxproc, tasks are not confined (task/none), nothing is accounted.
# Environment: SLURM_LOCAL_CPUS (default: all CPUs), SLURM_LOCAL_PARTITION (default: local),
# SLURM_LOCAL_WAIT (seconds to wait for an idle node, default 60).
set -euo pipefail

CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
LOG_DIR=/var/log/slurm
SPOOL_CTLD=/var/spool/slurmctld
SPOOL_D=/var/spool/slurmd
PARTITION=${SLURM_LOCAL_PARTITION:-local}
WAIT=${SLURM_LOCAL_WAIT:-60}
NODE=$(hostname -s)

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo -n"; fi

say() { echo "slurm-local: $*" >&2; }
die() { say "$*"; exit 1; }

install_if_missing() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
     && command -v sbatch >/dev/null; then
    return
  fi
  command -v apt-get >/dev/null || die "slurm is not installed and there is no apt-get; install slurm-wlm and munge"
  say "installing slurm-wlm and munge (apt-get)"
  $SUDO apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q slurm-wlm munge >/dev/null
}

write_config() {
  local cpus mem
  cpus=${SLURM_LOCAL_CPUS:-$(nproc)}
  # RealMemory above what slurmd measures drains the node ("Low RealMemory"): take slurmd's figure, minus 5%.
  mem=$(slurmd -C 2>/dev/null | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')
  mem=$(( ${mem:-1024} * 95 / 100 ))
  $SUDO mkdir -p "$CONF_DIR" "$LOG_DIR" "$SPOOL_CTLD" "$SPOOL_D"
  local tmp
  tmp=$(mktemp)
  cat >"$tmp" <<EOF
# Written by tokpack scripts/slurm-local.sh: one node, localhost, no cgroups, no accounting.
ClusterName=tokpack-local
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
ReturnToService=2
# Finished jobs stay visible to scontrol for 5 minutes (no accounting database to ask afterwards).
MinJobAge=300
InactiveLimit=0
KillWait=10
Waittime=0
StateSaveLocation=$SPOOL_CTLD
SlurmdSpoolDir=$SPOOL_D
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=$PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
  if ! cmp -s "$tmp" "$CONF" 2>/dev/null; then
    $SUDO install -m 644 "$tmp" "$CONF"
    say "wrote $CONF (node $NODE, $cpus CPUs, ${mem} MB)"
    CONFIG_CHANGED=1
  fi
  rm -f "$tmp"
}

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start_munge() {
  if $SUDO munge -n </dev/null 2>/dev/null | $SUDO unmunge >/dev/null 2>&1; then return; fi
  if [ ! -s /etc/munge/munge.key ]; then
    $SUDO mkdir -p /etc/munge
    $SUDO dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
  fi
  $SUDO chown munge:munge /etc/munge/munge.key 2>/dev/null || true
  $SUDO chmod 400 /etc/munge/munge.key
  $SUDO mkdir -p /run/munge /var/log/munge /var/lib/munge
  $SUDO chown munge:munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
  if id munge >/dev/null 2>&1; then
    $SUDO runuser -u munge -- /usr/sbin/munged
  else
    $SUDO /usr/sbin/munged --force
  fi
  for _ in $(seq 20); do
    if $SUDO munge -n </dev/null 2>/dev/null | $SUDO unmunge >/dev/null 2>&1; then return; fi
    sleep 0.5
  done
  die "munged does not answer (see /var/log/munge/munged.log)"
}

start_daemons() {
  if [ "${CONFIG_CHANGED:-0}" = 1 ] && pid_alive /run/slurmctld.pid; then
    say "configuration changed: restarting"
    stop_daemons
  fi
  if ! pid_alive /run/slurmctld.pid; then
    $SUDO /usr/sbin/slurmctld || die "slurmctld failed to start: $(tail -n 5 $LOG_DIR/slurmctld.log 2>/dev/null)"
  fi
  if ! pid_alive /run/slurmd.pid; then
    $SUDO /usr/sbin/slurmd || die "slurmd failed to start: $(tail -n 5 $LOG_DIR/slurmd.log 2>/dev/null)"
  fi
}

node_state() { sinfo -h -N -n "$NODE" -o %t 2>/dev/null | head -n 1; }

wait_idle() {
  local state=""
  for _ in $(seq $((WAIT * 2))); do
    state=$(node_state)
    case "$state" in
      idle|mix|alloc) say "node $NODE is $state (partition $PARTITION)"; return 0 ;;
      down*|drain*|drng*|fail*)
        # A node left down/drained by an earlier run comes back by hand.
        $SUDO scontrol update nodename="$NODE" state=resume 2>/dev/null || true ;;
    esac
    sleep 0.5
  done
  say "node $NODE did not become idle within ${WAIT}s (state: ${state:-unknown})"
  scontrol show node "$NODE" 2>&1 | grep -E "State|Reason" >&2 || true
  tail -n 5 "$LOG_DIR/slurmctld.log" "$LOG_DIR/slurmd.log" >&2 2>/dev/null || true
  return 1
}

stop_daemons() {
  local f
  for f in /run/slurmd.pid /run/slurmctld.pid; do
    if pid_alive "$f"; then $SUDO kill "$(cat "$f")"; fi
  done
  for _ in $(seq 40); do
    pid_alive /run/slurmd.pid || pid_alive /run/slurmctld.pid || return 0
    sleep 0.25
  done
  say "daemons still running after 10s"
}

case "${1:-start}" in
  start)
    install_if_missing
    write_config
    start_munge
    start_daemons
    wait_idle
    ;;
  stop)
    stop_daemons
    if pid_alive /run/munge/munged.pid; then $SUDO kill "$(cat /run/munge/munged.pid)"; fi
    say "stopped"
    ;;
  status)
    for d in munge/munged slurmctld slurmd; do
      if pid_alive "/run/$d.pid"; then echo "${d#*/}: running (pid $(cat /run/$d.pid))"; else echo "${d#*/}: stopped"; fi
    done
    sinfo 2>&1 || true
    squeue 2>&1 || true
    ;;
  *)
    echo "usage: $0 start|stop|status" >&2
    exit 2
    ;;
esac
