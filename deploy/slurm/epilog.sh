#!/usr/bin/env bash
# Slurm Epilog for GPU nodes: keep the agent's view of the node at the end of each job.
#   slurm.conf:  Epilog=/etc/slurm/sdcwatch-epilog.sh   (runs as root on each allocated node)
# Writes `sdcwatch status --json` to $SDCWATCH_JOB_DIR/<job id>.status.json (default /var/log/sdcwatch/jobs),
# so a job that ended badly can be matched with the GPUs' state, evidence and the job's own stats.
# It never fails the job or drains the node: an unreachable agent is logged and the epilog exits 0
# (the agent itself raises alerts; SDCWatchAgentDown covers an agent that is gone).
# Settings: SDCWATCH_BIN (sdcwatch), SDCWATCH_JOB_DIR, SDCWATCH_STATUS_TIMEOUT_S (20).
set -u
[ -r /etc/default/sdcwatch ] && . /etc/default/sdcwatch

bin="${SDCWATCH_BIN:-sdcwatch}"
dir="${SDCWATCH_JOB_DIR:-/var/log/sdcwatch/jobs}"
limit="${SDCWATCH_STATUS_TIMEOUT_S:-20}"
node="${SLURMD_NODENAME:-$(hostname -s)}"
job="${SLURM_JOB_ID:-unknown}"

log() {
  echo "sdcwatch-epilog: node=$node job=$job: $*" >&2
  command -v logger >/dev/null 2>&1 && logger -t sdcwatch-epilog -- "node=$node job=$job: $*"
  return 0
}

mkdir -p "$dir" 2>/dev/null || { log "cannot create $dir"; exit 0; }
tmp="$dir/.$job.status.json.$$"
if command -v timeout >/dev/null 2>&1; then
  timeout "$limit" "$bin" status --json >"$tmp" 2>"$tmp.err"; rc=$?
else
  "$bin" status --json >"$tmp" 2>"$tmp.err"; rc=$?
fi
# status exits 0 healthy, 1 SUSPECT/DEGRADED/FAILED, 3 UNKNOWN: each prints the JSON; 2 is unreachable
if { [ "$rc" -eq 0 ] || [ "$rc" -eq 1 ] || [ "$rc" -eq 3 ]; } && [ -s "$tmp" ]; then
  mv -f "$tmp" "$dir/$job.status.json"
else
  log "sdcwatch status failed (exit $rc): $(head -c 300 "$tmp.err" 2>/dev/null)"
  rm -f "$tmp"
fi
rm -f "$tmp.err"
exit 0
