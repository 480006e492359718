#!/usr/bin/env bash
# Start the agent on the embedded defaults (its own Redis, a temp state dir), show its status and
# events, and stop it. Used by the README until `sdcwatch demo` lands.
set -euo pipefail
cd "$(dirname "$0")/.."
SDCW=.venv/bin/sdcwatch
state=$(mktemp -d /tmp/sdcwatch-quickstart.XXXXXX)
$SDCW run --state-dir "$state" --metrics-listen 127.0.0.1:0 --log-level WARNING &
agent=$!
trap 'kill -TERM $agent 2>/dev/null; wait $agent 2>/dev/null; rm -rf "$state"' EXIT
for _ in $(seq 1 200); do
  [ -S "$state/agent.sock" ] && $SDCW status --socket "$state/agent.sock" --timeout 1 >/dev/null 2>&1 && break
  sleep 0.1
done
echo "== sdcwatch status"
$SDCW status --socket "$state/agent.sock" || true
echo
echo "== sdcwatch events"
$SDCW events --socket "$state/agent.sock"
