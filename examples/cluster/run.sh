#!/usr/bin/env bash
# Two worker nodes on loopback and a driver that generates across them (3 ranks: one in
# the driver, one on each node). Run from the repository root after a build:
#
#   bash examples/cluster/run.sh [MODEL]
#
# MODEL defaults to the demo's SmolLM2-135M-Instruct (fetched by scripts/demo.sh).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${BUILD_DIR:-$root/build}
cache=${TROUPE_MODEL_CACHE:-$HOME/.cache/troupe/models}
model=${1:-$cache/SmolLM2-135M-Instruct.Q4_1.gguf}
[ -e "$model" ] || { echo "run.sh: no model at $model (run scripts/demo.sh first)" >&2; exit 1; }

work=$(mktemp -d)
nodes=()
cleanup() {
  for pid in "${nodes[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$work/secret"

for port in 7461 7462; do
  "$build/troupe" node --listen 127.0.0.1:$port --devices cpu:1 --secret-file "$work/secret" \
    2> "$work/node-$port.log" &
  nodes+=($!)
done
sleep 1
"$build/examples/cluster/cluster_driver" "$model" "$work/secret" 127.0.0.1:7461 127.0.0.1:7462
