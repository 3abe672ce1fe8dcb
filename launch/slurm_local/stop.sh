#!/usr/bin/env bash
# Stop the cluster started by start.sh: cancel jobs, let their steps drain, then stop the daemons.
scancel --user="$(id -un)" 2>/dev/null || true
for _ in $(seq 1 20); do
  [ -z "$(squeue -h 2>/dev/null)" ] && ! pgrep -x slurmstepd >/dev/null && break
  sleep 0.5
done
for f in /run/slurmd.pid /run/slurmctld.pid /run/munge/munged.pid; do
  [ -s "$f" ] && kill "$(cat "$f")" 2>/dev/null || true
done
for _ in $(seq 1 20); do
  pgrep -x slurmd >/dev/null || pgrep -x slurmctld >/dev/null || pgrep -x munged >/dev/null || break
  sleep 0.5
done
