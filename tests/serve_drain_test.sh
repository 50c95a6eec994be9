#!/usr/bin/env bash
# troupe serve drains on SIGTERM: a stream in flight when the signal comes is answered to
# its end, new connections are refused, and the server exits 0. Arguments: the troupe
# binary, the source tree.
set -uo pipefail
troupe=$1
source_dir=$2
out=$(mktemp -d)
trap 'kill -9 $server 2> /dev/null; rm -rf "$out"' EXIT
"$troupe" serve --model "$source_dir/tests/fixtures/llama-gqa" --kv-cache-memory 4000000 \
  --port 0 --served-model-name tiny > "$out/serve.log" 2>&1 &
server=$!
port=
for _ in $(seq 1 300); do
  port=$(sed -n 's|.*on http://127.0.0.1:\([0-9]*\).*|\1|p' "$out/serve.log")
  [ -n "$port" ] && break
  sleep 0.1
done
if [ -z "$port" ]; then
  echo "FAILED: the server did not start"; cat "$out/serve.log"; exit 1
fi
# A long stream; the signal comes once its first event is in.
curl -s -N -H 'Content-Type: application/json' \
  -d '{"prompt":[1,2,3],"max_tokens":400,"temperature":0,"ignore_eos":true,"stream":true}' \
  "http://127.0.0.1:$port/v1/completions" > "$out/stream.txt" &
client=$!
for _ in $(seq 1 100); do
  [ -s "$out/stream.txt" ] && break
  sleep 0.05
done
kill -TERM $server
wait $client
wait $server
status=$?
cat "$out/serve.log" | tail -3
if [ $status -ne 0 ]; then
  echo "FAILED: the server exited with $status after SIGTERM"; exit 1
fi
if ! grep -q '"finish_reason":"length"' "$out/stream.txt" || ! grep -q 'data: \[DONE\]' "$out/stream.txt"; then
  echo "FAILED: the stream in flight did not end normally:"; tail -c 600 "$out/stream.txt"; exit 1
fi
tokens=$(grep -o '"token_ids":\[[0-9,]*\]' "$out/stream.txt" | grep -o '[0-9]\+' | wc -l)
if [ "$tokens" -ne 400 ]; then
  echo "FAILED: the stream carried $tokens tokens, not 400"; exit 1
fi
if curl -s -o /dev/null "http://127.0.0.1:$port/health"; then
  echo "FAILED: the server still answers after draining"; exit 1
fi
echo "drained: the stream in flight got its 400 tokens and the server exited 0"
