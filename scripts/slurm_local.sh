#!/usr/bin/env bash
# A real one-machine SLURM cluster (munged, slurmctld, slurmd on this host), to try and test
# `launcher=slurm` without a cluster. Needs root and Debian/Ubuntu packages (slurm-wlm, munge).
#
#   bash scripts/slurm_local.sh start    # install if missing, configure, start; waits until idle
#   bash scripts/slurm_local.sh status   # the daemons and `sinfo`
#   bash scripts/slurm_local.sh stop     # stop the daemons (config and state stay)
#
# One node (this host, its CPUs and memory), one partition `debug`, requeue allowed. The
# config goes to /etc/slurm/slurm.conf, state and logs to /var/lib/slurm-local; a slurm.conf
# that this script did not write is left alone.
set -euo pipefail

STATE=/var/lib/slurm-local
CONF=/etc/slurm/slurm.conf
MARK="# written by scripts/slurm_local.sh"
PARTITION=debug

die() { echo "slurm_local: $*" >&2; exit 1; }

install_packages() {
  command -v slurmctld >/dev/null && command -v munged >/dev/null && return
  command -v apt-get >/dev/null || die "slurm-wlm and munge are missing and apt-get is not available"
  echo "slurm_local: installing slurm-wlm and munge (apt)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q slurm-wlm munge >/dev/null
}

write_config() {
  if [ -f "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
    die "$CONF exists and was not written by this script; not touching it"
  fi
  local host cpus mem_mib
  host="$(hostname)"
  cpus="$(nproc)"
  # slurmd drains a node that has less memory than configured: leave 5% for the system.
  mem_mib="$(awk '/MemTotal/ {print int($2 / 1024 * 0.95)}' /proc/meminfo)"
  mkdir -p "$STATE/ctld" "$STATE/d" /etc/slurm
  cat >"$CONF" <<EOF
$MARK
ClusterName=local
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job waits cred_expire + 1 s before it may start again (120 s by default): 10 s
# keeps the real wait in the preemption tests without making them slow.
AuthInfo=cred_expire=10
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
# No cgroups in containers: plain process tracking, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
# Preempted and timed-out jobs requeue themselves (scontrol requeue).
JobRequeue=1
ReturnToService=2
NodeName=$host CPUs=$cpus RealMemory=$mem_mib State=UNKNOWN
PartitionName=$PARTITION Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
}

start_munge() {
  pgrep -x munged >/dev/null && return
  if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  chown munge:munge /etc/munge/munge.key
  chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  su -s /bin/sh munge -c /usr/sbin/munged
}

# A daemon of this cluster, by its pid file: another cluster's slurmctld or slurmd may run on
# this machine too (the lab's SLURM, ddp_template.tools.slurm_lab). munged is shared.
running() {
  if [ "$1" = munged ]; then pgrep -x munged >/dev/null; return; fi
  [ -s "$STATE/$1.pid" ] && kill -0 "$(cat "$STATE/$1.pid")" 2>/dev/null
}

node_state() { sinfo -h -N -o '%T' 2>/dev/null | head -1; }

start() {
  [ "$(id -u)" = 0 ] || die "needs root (it installs packages and starts system daemons)"
  install_packages
  write_config
  start_munge
  running slurmctld || slurmctld
  running slurmd || slurmd
  local state=""
  for _ in $(seq 60); do
    state="$(node_state)"
    case "$state" in
      idle | mixed | allocated) echo "slurm_local: node $(hostname) is $state"; return ;;
      drain* | down*) scontrol update NodeName="$(hostname)" State=RESUME 2>/dev/null || true ;;
    esac
    sleep 1
  done
  die "the node did not become idle (state: ${state:-none}); see $STATE/slurmctld.log and slurmd.log"
}

stop() {
  local pidfile
  for daemon in slurmd slurmctld; do
    pidfile="$STATE/$daemon.pid"
    if [ -s "$pidfile" ]; then
      kill "$(cat "$pidfile")" 2>/dev/null || true
    fi
  done
  for _ in $(seq 20); do
    running slurmd || running slurmctld || break
    sleep 0.5
  done
  echo "slurm_local: stopped slurmd and slurmctld (munged keeps running)"
}

status() {
  for daemon in munged slurmctld slurmd; do
    if running "$daemon"; then echo "$daemon: running"; else echo "$daemon: stopped"; fi
  done
  running slurmctld && sinfo
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) die "usage: $0 start|stop|status" ;;
esac
