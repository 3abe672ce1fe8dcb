#!/usr/bin/env bash
# A single-node Slurm cluster on this machine, for tests and CI (Debian/Ubuntu, as root, no systemd needed).
# Installs slurmctld, slurmd, slurm-client and munge if missing, writes a one-node configuration (partition
# "debug", node "localhost"), starts munged, slurmctld and slurmd, and waits until the node is idle.
set -euo pipefail
if [ "$(id -u)" != 0 ]; then echo "start.sh: needs root (installs packages, starts daemons)" >&2; exit 1; fi
export DEBIAN_FRONTEND=noninteractive
if ! command -v slurmctld >/dev/null; then
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
fi
if [ ! -s /etc/munge/munge.key ]; then
  mungekey --create 2>/dev/null || dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
  chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
fi
mkdir -p /run/munge /var/spool/slurmd /var/spool/slurmctld /var/log/slurm /etc/slurm
chown munge:munge /run/munge
# Accounting is off and processes are tracked without cgroups, which containers often lack.
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=pocketlm-local
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
# Short grace between a job's SIGTERM and SIGKILL, so requeue tests do not idle.
KillWait=5
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmdSpoolDir=/var/spool/slurmd
StateSaveLocation=/var/spool/slurmctld
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$(nproc) RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
CONF
pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged
pgrep -x slurmctld >/dev/null || /usr/sbin/slurmctld
pgrep -x slurmd >/dev/null || /usr/sbin/slurmd -N localhost
for _ in $(seq 1 60); do
  state=$(sinfo -h -o %T 2>/dev/null || true)
  [ "$state" = idle ] && break
  [ "$state" = down ] || [ "$state" = drained ] && scontrol update nodename=localhost state=resume 2>/dev/null || true
  sleep 0.5
done
sinfo
