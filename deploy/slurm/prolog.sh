#!/usr/bin/env bash
# Slurm Prolog for GPU nodes: run sdcwatch's quick canary before a job starts on the node.
#   slurm.conf:  Prolog=/etc/slurm/sdcwatch-prolog.sh   (runs as root on each allocated node)
# Canary exit codes (sdcwatch canary):
#   0 PASS   -> the job starts
#   1 FAIL   -> a GPU computed a wrong answer, or the node has GPUs that NVML sees but CUDA cannot use
#               (fell off the bus, broken driver): drain the node (scontrol) with the canary's last line as
#               the reason and exit 1, so Slurm requeues the job away from this node
#   2 could not run (no GPU at all, no torch, bad setup) -> logged with the reason, the job starts: the
#               monitor must never be the reason a healthy node refuses work
#   anything else (timeout 124, missing binary 127, ...) -> logged only, the job starts
# Settings (environment, e.g. from /etc/default/sdcwatch sourced below):
#   SDCWATCH_BIN (sdcwatch), SDCWATCH_CANARY_LEVEL (quick), SDCWATCH_CANARY_TIMEOUT_S (120),
#   SDCWATCH_DRAIN (1; 0 = log a FAIL but do not drain)
set -u
[ -r /etc/default/sdcwatch ] && . /etc/default/sdcwatch

bin="${SDCWATCH_BIN:-sdcwatch}"
level="${SDCWATCH_CANARY_LEVEL:-quick}"
limit="${SDCWATCH_CANARY_TIMEOUT_S:-120}"
node="${SLURMD_NODENAME:-$(hostname -s)}"
job="${SLURM_JOB_ID:-?}"

log() {
  echo "sdcwatch-prolog: node=$node job=$job: $*" >&2
  command -v logger >/dev/null 2>&1 && logger -t sdcwatch-prolog -- "node=$node job=$job: $*"
  return 0
}

if command -v timeout >/dev/null 2>&1; then
  out="$(timeout "$limit" "$bin" canary --level "$level" 2>&1)"; rc=$?
else
  out="$("$bin" canary --level "$level" 2>&1)"; rc=$?
fi

case "$rc" in
  0)
    exit 0
    ;;
  1)
    reason="sdcwatch canary FAIL before job $job: $(printf '%s' "$out" | tail -n 1 | cut -c1-200)"
    log "canary FAILED ($level): $out"
    if [ "${SDCWATCH_DRAIN:-1}" = 1 ]; then
      if scontrol update nodename="$node" state=drain reason="$reason"; then
        log "node drained: $reason"
      else
        log "scontrol could not drain the node (exit $?)"
      fi
    fi
    exit 1
    ;;
  2)
    log "canary could not run (exit 2), job allowed: why: $(printf '%s' "$out" | tail -n 1 | cut -c1-300)"
    log "canary output: $out"
    exit 0
    ;;
  *)
    log "canary did not finish (exit $rc; 124 = timeout after ${limit}s, 127 = $bin not found), job allowed: $out"
    exit 0
    ;;
esac
