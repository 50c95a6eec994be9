#!/usr/bin/env bash
# An executor whose workers live on a node destroys its actor system at shutdown, every
# time: `troupe bench rpc` against a `troupe node` on loopback, ten times, must never log
# that the system was left behind. Destroyed while the middleman still served the node's
# connection, the system used to keep a reference to the supervisor now and then (about
# one run in six here) and was abandoned after the grace period.
# Arguments: the troupe binary.
set -uo pipefail
troupe=$1
dir=$(mktemp -d)
trap 'kill "$node" 2>/dev/null; wait "$node" 2>/dev/null; rm -rf "$dir"' EXIT
head -c 32 /dev/urandom | base64 > "$dir/secret"
chmod 600 "$dir/secret"
"$troupe" node --listen 127.0.0.1:0 --devices cpu:1 --secret-file "$dir/secret" > "$dir/node.log" 2>&1 &
node=$!
port=
for _ in $(seq 1 100); do
  port=$(grep -o 'listening on 127.0.0.1:[0-9]*' "$dir/node.log" | head -1 | sed 's/.*://')
  [ -n "$port" ] && break
  sleep 0.1
done
if [ -z "$port" ]; then
  echo "FAILED: the node did not say where it listens"; cat "$dir/node.log"; exit 1
fi
for run in $(seq 1 10); do
  if ! "$troupe" bench rpc --workers 1 --nodes "127.0.0.1:$port/1" --secret-file "$dir/secret" \
      --iterations 500 --idle-seconds 1 --json > "$dir/run.log" 2>&1; then
    echo "FAILED: run $run exited with an error"; cat "$dir/run.log"; exit 1
  fi
  if grep -E 'did not stop|still busy' "$dir/run.log"; then
    echo "FAILED: run $run left its actor system behind"; exit 1
  fi
done
echo "10 runs, each actor system destroyed"
