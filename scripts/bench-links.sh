#!/usr/bin/env bash
# A call to one node worker on this host, by the way its call goes (BASP, a call link over
# TCP, over the node's local socket, through shared memory), with the shared secret and
# under mutual TLS, in alternating rounds (`troupe bench rpc --workers 1 --nodes …/1`).
# Prints one JSON line per run and a JSON summary last (median p50 and p99 per mode, and
# TLS's p50 over the secret's).
#   bash scripts/bench-links.sh [--rounds N] [--iterations N]
# Needs build/troupe and the openssl command.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=3
iterations=3000
while [ $# -gt 0 ]; do
  case $1 in
    --rounds) rounds=$2; shift 2 ;;
    --iterations) iterations=$2; shift 2 ;;
    *) echo "bench-links: unknown argument $1" >&2; exit 2 ;;
  esac
done
troupe=build/troupe
[ -x "$troupe" ] || { echo "bench-links: build $troupe first" >&2; exit 1; }

dir=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT
(
  cd "$dir"
  openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=ca -keyout ca.key -out ca.pem \
    2>/dev/null
  for who in node executor; do
    openssl req -newkey rsa:2048 -nodes -subj "/CN=$who" -keyout $who.key -out $who.csr \
      2>/dev/null
    openssl x509 -req -in $who.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 \
      -out $who.pem 2>/dev/null
  done
  head -c 48 /dev/urandom | base64 > secret
)

# A free port on loopback for each node.
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}
secret_port=$(free_port)
tls_port=$(free_port)
"$troupe" node --listen 127.0.0.1:$secret_port --devices cpu:1 --secret-file "$dir/secret" \
  > "$dir/secret-node.log" 2>&1 &
pids+=($!)
"$troupe" node --listen 127.0.0.1:$tls_port --devices cpu:1 --tls-cert "$dir/node.pem" \
  --tls-key "$dir/node.key" --tls-ca "$dir/ca.pem" > "$dir/tls-node.log" 2>&1 &
pids+=($!)
sleep 1

# mode name | options
modes=("basp|--node-links 0"
       "tcp|--node-local-links 0"
       "unix_socket|--node-shared-memory 0"
       "shared_memory|")
results=$dir/results.jsonl
for ((round = 1; round <= rounds; round++)); do
  for entry in "${modes[@]}"; do
    via=${entry%%|*}
    opts=${entry#*|}
    for proof in secret tls; do
      if [ $proof = secret ]; then
        creds=(--nodes 127.0.0.1:$secret_port/1 --secret-file "$dir/secret")
      else
        creds=(--nodes 127.0.0.1:$tls_port/1 --tls-cert "$dir/executor.pem"
               --tls-key "$dir/executor.key" --tls-ca "$dir/ca.pem")
      fi
      # shellcheck disable=SC2086
      line=$("$troupe" bench rpc --workers 1 --iterations "$iterations" --idle-seconds 1 \
               --json "${creds[@]}" $opts 2>/dev/null | tail -1)
      python3 -c '
import json, sys
runs = json.loads(sys.argv[1])
idle = next(r for r in runs if r["mode"] == "idle_nodes")
print(json.dumps({"round": int(sys.argv[2]), "via": sys.argv[3], "proof": sys.argv[4],
                  "p50_us": idle["p50_us"], "p99_us": idle["p99_us"]}))
' "$line" "$round" "$via" "$proof" | tee -a "$results"
    done
  done
done
python3 - "$results" <<'EOF'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
summary = {}
for via in dict.fromkeys(r["via"] for r in runs):
    row = {}
    for proof in ("secret", "tls"):
        mine = [r for r in runs if r["via"] == via and r["proof"] == proof]
        row[proof + "_p50_us"] = statistics.median(r["p50_us"] for r in mine)
        row[proof + "_p99_us"] = statistics.median(r["p99_us"] for r in mine)
    row["tls_over_secret_p50"] = round(row["tls_p50_us"] / row["secret_p50_us"], 2)
    summary[via] = row
print(json.dumps({"bench": "links", "rounds": max(r["round"] for r in runs), "modes": summary}))
EOF
