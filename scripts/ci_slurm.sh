#!/usr/bin/env bash
# A local SLURM cluster (one node, or SLURM_CI_NODES emulated ones) for CI and for trying
# scripts/slurm/*.sbatch (root only).
#
#   scripts/ci_slurm.sh [start]   install slurm + munge if missing, write slurm.conf, start
#                                 munged / slurmctld / slurmd, wait until the node is idle
#   scripts/ci_slurm.sh stop      stop what `start` started (by pid file, nothing else)
#   scripts/ci_slurm.sh status    print the node state; exit 0 only when it is up
#   scripts/ci_slurm.sh env       print `export SLURM_CONF=...` (eval it to use sbatch/sinfo)
#
# Idempotent: `start` on a running cluster only checks it; `stop` on a stopped one is a no-op.
# Nothing is written outside $SLURM_CI_DIR except /run/munge (munged's socket) and the
# packages. Clients find the cluster through SLURM_CONF (no /etc/slurm/slurm.conf is written).
#
# Environment (defaults):
#   SLURM_CI_DIR=/tmp/mcore-rl-slurm    conf, state, spool, pid and log files
#   SLURM_CI_NODES=1                    >1: that many emulated nodes node1..nodeN on this
#                                       host (one slurmd each, the CPUs split between them;
#                                       their names are added to /etc/hosts if they do not
#                                       resolve) — to try multi-node jobs (train.sbatch -N 2)
#   SLURM_CI_NODE=localhost             the node's name when SLURM_CI_NODES=1 (127.0.0.1)
#   SLURM_CI_CTLD_PORT=6817 SLURM_CI_SLURMD_PORT=6818 (node i: +i-1)
#   SLURM_CI_START_TIMEOUT=60           seconds to wait for the node to become idle
#
# Settings for a CI machine: root, no systemd, no cgroups
# (proctrack/linuxproc, task/none); MinJobAge=5: `sbatch --wait` polls the job after 2 s, then
# quadruples its interval while it is below MinJobAge/2 (up to 32 s: every 8 s with
# MinJobAge=15, every 32 s with the default 300), so with 5 it polls every 2 s and returns
# within 2 s of the job's end; a finished job whose record slurmctld purged between two polls
# makes it return 0 whatever the job's exit code, so MinJobAge must outlast one poll interval
# (5 > 2; slurmctld purges records older than MinJobAge every max(10, MinJobAge) s);
# cred_expire=5 (the least slurm accepts) and sched_interval=2 so that a requeued job starts
# again within seconds.
set -euo pipefail

DIR="${SLURM_CI_DIR:-/tmp/mcore-rl-slurm}"
NNODES="${SLURM_CI_NODES:-1}"
if [ "$NNODES" -gt 1 ]; then
  NODES=(); for i in $(seq "$NNODES"); do NODES+=("node$i"); done
else
  NODES=("${SLURM_CI_NODE:-localhost}")
fi
CTLD_PORT="${SLURM_CI_CTLD_PORT:-6817}"
SLURMD_PORT="${SLURM_CI_SLURMD_PORT:-6818}"
START_TIMEOUT="${SLURM_CI_START_TIMEOUT:-60}"
CONF="$DIR/slurm.conf"
export SLURM_CONF="$CONF"

log() { echo "ci_slurm: $*" >&2; }
die() { log "error: $*"; exit 1; }

alive() {  # alive PIDFILE: the pid in PIDFILE is a running process
  [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

node_states() {  # one line per node: NAME STATE
  timeout 10 sinfo -h -N -o "%N %T" 2>/dev/null || true
}

all_up() {  # every node idle/mixed/allocated
  local states
  states=$(node_states)
  [ "$(echo "$states" | grep -cE ' (idle|mixed|allocated|completing)$')" -eq "${#NODES[@]}" ]
}

install_packages() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
     && command -v sbatch >/dev/null && [ -x /usr/sbin/munged ]; then
    return
  fi
  [ "$(id -u)" = 0 ] || die "slurm/munge are not installed and installing them needs root"
  command -v apt-get >/dev/null || die "slurm/munge are not installed and apt-get is missing"
  log "installing slurmctld slurmd slurm-client munge"
  timeout 300 apt-get update -qq
  DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge >/dev/null
}

write_conf() {
  local cpus mem node_line
  # (nproc obeys OMP_NUM_THREADS, which test runners set to 1: not what the machine has)
  cpus=$(( $(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc) / NNODES ))
  [ "$cpus" -ge 1 ] || cpus=1
  mem=$(awk -v n="$NNODES" '/^MemTotal:/ {printf "%d", $2 / 1024 * 0.85 / n}' /proc/meminfo)
  mkdir -p "$DIR/state" "$DIR/log" "$DIR/run"
  for node in "${NODES[@]}"; do mkdir -p "$DIR/spool/slurmd-$node"; done
  if [ "$NNODES" -gt 1 ]; then
    node_line="NodeName=node[1-$NNODES] NodeHostname=localhost NodeAddr=127.0.0.1"
    node_line+=" Port=$SLURMD_PORT-$((SLURMD_PORT + NNODES - 1))"
  else
    node_line="NodeName=${NODES[0]} NodeAddr=127.0.0.1 Port=$SLURMD_PORT"
  fi
  cat >"$CONF.tmp" <<EOF
# Written by scripts/ci_slurm.sh — a local test cluster; edits are overwritten.
ClusterName=local
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$CTLD_PORT
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
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MailProg=/bin/true
MinJobAge=5
KillWait=10
# a requeued job may start again once its credential expired (default 120 s) and the
# scheduler next runs (default every 60 s): short, so a requeue test takes seconds
AuthInfo=cred_expire=5
SchedulerParameters=sched_interval=2
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/slurmd-%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
$node_line CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  mv "$CONF.tmp" "$CONF"
}

start_munge() {
  if [ -S /run/munge/munge.socket.2 ] && timeout 5 munge -n </dev/null >/dev/null 2>&1; then
    return  # a munged is already serving (ours from an earlier start, or the system's)
  fi
  install -d -o munge -g munge -m0755 /run/munge
  runuser -u munge -- /usr/sbin/munged
  echo started >"$DIR/run/munged.ours"
  for _ in $(seq 50); do
    timeout 5 munge -n </dev/null >/dev/null 2>&1 && return
    sleep 0.1
  done
  die "munged did not start"
}

daemons_alive() {
  alive "$DIR/run/slurmctld.pid" || return 1
  for node in "${NODES[@]}"; do alive "$DIR/run/slurmd-$node.pid" || return 1; done
}

resolve_nodes() {  # emulated node names must resolve (slurmd and srun look them up)
  [ "$NNODES" -gt 1 ] || return 0
  for node in "${NODES[@]}"; do
    getent hosts "$node" >/dev/null && continue
    [ "$node" != "$(hostname)" ] || die "node name $node equals this host's name"
    log "adding '127.0.0.1 $node' to /etc/hosts"
    echo "127.0.0.1 $node  # scripts/ci_slurm.sh" >>/etc/hosts
  done
}

start() {
  install_packages
  mkdir -p "$DIR/run"
  if daemons_alive && all_up; then
    log "already running ($CONF)"
    return
  fi
  resolve_nodes
  write_conf
  start_munge
  alive "$DIR/run/slurmctld.pid" || slurmctld -i -f "$CONF"
  for node in "${NODES[@]}"; do
    alive "$DIR/run/slurmd-$node.pid" || slurmd -f "$CONF" -N "$node"
  done
  local deadline=$((SECONDS + START_TIMEOUT)) states=""
  while [ $SECONDS -lt $deadline ]; do
    if all_up; then
      log "up: ${NODES[*]} ($CONF; use: export SLURM_CONF=$CONF)"
      return
    fi
    states=$(node_states)
    if echo "$states" | grep -qE ' (down|drain)'; then
      timeout 10 scontrol update NodeName="$(IFS=,; echo "${NODES[*]}")" State=RESUME \
        >/dev/null 2>&1 || true
    fi
    sleep 0.5
  done
  log "nodes not idle after ${START_TIMEOUT}s (states: '${states:-no answer}'); last log lines:"
  tail -n 20 "$DIR/log/"*.log >&2 || true
  exit 1
}

stop_pidfile() {  # stop_pidfile NAME PIDFILE
  local pid
  alive "$2" || { rm -f "$2"; return; }
  pid=$(cat "$2")
  kill "$pid"
  for _ in $(seq 100); do
    kill -0 "$pid" 2>/dev/null || { rm -f "$2"; return; }
    sleep 0.1
  done
  log "$1 (pid $pid) ignored SIGTERM for 10 s: killing it"
  kill -9 "$pid" 2>/dev/null || true
  rm -f "$2"
}

stop() {
  for pidfile in "$DIR"/run/slurmd-*.pid; do
    [ -e "$pidfile" ] && stop_pidfile "$(basename "$pidfile" .pid)" "$pidfile"
  done
  stop_pidfile slurmctld "$DIR/run/slurmctld.pid"
  if [ -f "$DIR/run/munged.ours" ]; then
    stop_pidfile munged /run/munge/munged.pid
    rm -f "$DIR/run/munged.ours"
  fi
  log "stopped"
}

case "${1:-start}" in
  start) start ;;
  stop) stop ;;
  status)
    node_states
    daemons_alive && all_up ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) die "usage: $0 [start|stop|status|env]" ;;
esac
