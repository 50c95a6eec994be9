#!/usr/bin/env bash
# troupe next to llama.cpp's own tools, built natively from source, on the same GGUF files
# and the same threads, in one run with alternating processes: decode at batch 1 after 512
# tokens of context (troupe decodes after its prefill, llama-bench at `-d 512`) and
# prefill of 512 tokens (`llama-bench` against `troupe bench step`, each after one
# prefill to warm up), batched decode at 8
# and 32 (`llama-batched-bench`), start-up to one token with its peak resident memory
# (`llama-simple` against `troupe generate`, the file in the page cache; troupe's with its
# weight cache written by the runs before, its first start, which writes the cache, as
# "startup_first", and the command line's default exact path without a cache as
# "startup_exact"), and the bandwidth floor of this machine (the weights' bytes over the read bandwidth of every core, which
# `troupe bench step` measures in the same process). Prints one JSON object per
# measurement, then a table of medians and ratios. A benchmark, not a test: the llama.cpp
# build takes minutes once, the model files a few minutes once (both cached).
#
#   bash scripts/bench-vs-llamacpp.sh [--rounds N] [--precision fast|exact] [MODEL.gguf ...]
#
# Without files it compares on the models of scripts/llamacpp-lib.sh (SmolLM2, and the 1B
# shape as Q4_K_M, Q4_0, Q8_0 and BF16; TROUPE_SCALE_SHAPES="llama-1b llama-8b"
# adds the 8B: the variable is the list of shapes), which also says
# where llama.cpp and the models are cached.
set -euo pipefail
cd "$(dirname "$0")/.."

rounds=3
precision=fast
models=()
while [ $# -gt 0 ]; do
  case $1 in
    --rounds) rounds=$2; shift 2 ;;
    --precision) precision=$2; shift 2 ;;
    *) models+=("$1"); shift ;;
  esac
done
source scripts/llamacpp-lib.sh
build_llamacpp
[ ${#models[@]} -eq 0 ] && default_models

# One measurement of each side, alternating; JSON lines into $results. troupe's weight
# cache is the run's own.
results=$(mktemp)
weight_cache=$(mktemp -d)
trap 'rm -rf "$results" "$results.time" "$weight_cache"' EXIT
llama_bench() { # model, then llama-bench's shape flags
  local model=$1
  shift
  "$bin/llama-bench" -m "$model" -t "$threads" -r 1 -o json "$@" 2> /dev/null |
    python3 -c 'import json, sys
for r in json.load(sys.stdin):
    kind = "prefill" if r["n_gen"] == 0 else "decode"
    print(json.dumps({"engine": "llama.cpp", "model": sys.argv[1], "what": kind,
                      "tokens_per_s": r["avg_ts"]}))' "$model"
}
troupe_step() { # model, then troupe bench step's flags
  local model=$1
  shift
  "$troupe" bench step --model "$model" --cpu-precision "$precision" --json "$@" \
    2> /dev/null | tail -1 | python3 -c 'import json, sys
d = json.load(sys.stdin)
m, batch = sys.argv[1], d["batch"]
if batch == 1:
    print(json.dumps({"engine": "troupe", "model": m, "what": "prefill",
                      "tokens_per_s": d["prefill_tokens_per_s"]}))
    print(json.dumps({"engine": "troupe", "model": m, "what": "decode",
                      "tokens_per_s": d["decode_tokens_per_s"]}))
    print(json.dumps({"engine": "floor", "model": m, "what": "decode",
                      "tokens_per_s": d["bandwidth_bound_decode_tokens_per_s"]}))
else:
    print(json.dumps({"engine": "troupe", "model": m, "what": "decode_batch%d" % batch,
                      "tokens_per_s": d["decode_tokens_per_s"]}))' "$model"
}
llama_batched() { # model: 8 and 32 sequences of 16 prompt tokens, 32 steps each
  "$bin/llama-batched-bench" -m "$1" -t "$threads" -c 4096 -npp 16 -ntg 32 -npl 8,32 \
    --output-format jsonl 2> /dev/null | python3 -c 'import json, sys
for line in sys.stdin:
    if line.startswith("{"):
        r = json.loads(line)
        print(json.dumps({"engine": "llama.cpp", "model": sys.argv[1],
                          "what": "decode_batch%d" % r["pl"], "tokens_per_s": r["speed_tg"]}))' "$1"
}
startup() { # engine, model, what (startup or startup_first), then the command: wall
  # seconds and peak resident bytes
  local engine=$1 model=$2 what=$3
  shift 3
  # Each start from the files it reads in the page cache: a start before may have pushed
  # some of them out (the 8B files, a first start's cache and the warm one do not all fit
  # in 24 GB). A start with troupe's weight cache reads the cache file too.
  cat "$model" > /dev/null
  if [ "$engine $what" = "troupe startup" ]; then
    cat "$TROUPE_WEIGHT_CACHE"/* > /dev/null 2>&1 || true
  fi
  /usr/bin/time -f "%e %M" -o "$results.time" "$@" > /dev/null 2>&1
  python3 -c 'import json, sys
seconds, kib = open(sys.argv[4]).read().split()[-2:]
print(json.dumps({"engine": sys.argv[1], "model": sys.argv[2], "what": sys.argv[3] + "_s",
                  "value": float(seconds)}))
print(json.dumps({"engine": sys.argv[1], "model": sys.argv[2],
                  "what": sys.argv[3] + "_peak_mib", "value": int(kib) / 1024}))' \
    "$engine" "$model" "$what" "$results.time"
}
for model in "${models[@]}"; do
  # Each model's cache in a folder of its own, so a start warms only its own.
  export TROUPE_WEIGHT_CACHE=$weight_cache/warm/$(basename "$model")
  # The file into the page cache first: both sides start from it.
  cat "$model" > /dev/null
  for round in $(seq 1 "$rounds"); do
    {
      llama_bench "$model" -p 0 -n 32 -d 512
      troupe_step "$model" --prompt-len 512 --decode-steps 32
      llama_bench "$model" -p 512 -n 0
      troupe_step "$model" --batch 8 --prompt-len 16 --decode-steps 32
      troupe_step "$model" --batch 32 --prompt-len 16 --decode-steps 32
      llama_batched "$model"
      startup llama.cpp "$model" startup "$bin/llama-simple" -m "$model" -n 1 "Hello world"
      startup troupe "$model" startup "$troupe" generate --model "$model" \
        --prompt "Hello world" --max-tokens 1 --cpu-precision "$precision" \
        --kv-cache-memory $((64 << 20))
      startup troupe "$model" startup_first "$troupe" generate --model "$model" \
        --prompt "Hello world" --max-tokens 1 --cpu-precision "$precision" \
        --kv-cache-memory $((64 << 20)) --weight-cache "$weight_cache/first"
      rm -rf "$weight_cache/first"
      # The command line's default precision (exact): the weights used from the file's
      # pages where their layout allows, no weight cache.
      startup troupe "$model" startup_exact "$troupe" generate --model "$model" \
        --prompt "Hello world" --max-tokens 1 --cpu-precision exact \
        --kv-cache-memory $((64 << 20)) --weight-cache off
    } | tee -a "$results"
  done
done

python3 - "$results" <<'PY'
import collections, json, os, statistics, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    r = json.loads(line)
    runs[(r["model"], r["what"], r["engine"])].append(r.get("tokens_per_s", r.get("value")))
median = {k: statistics.median(v) for k, v in runs.items()}
print(f"\n{'model':34} {'measure':16} {'troupe':>8} {'llama.cpp':>9} {'ratio':>6} {'floor':>7}")
for model in dict.fromkeys(k[0] for k in median):
    for what in ("decode", "prefill", "decode_batch8", "decode_batch32", "startup_s",
                 "startup_peak_mib", "startup_first_s", "startup_first_peak_mib",
                 "startup_exact_s", "startup_exact_peak_mib"):
        # A first start, and the exact path's, are compared with llama.cpp's start, which
        # has no cache to write.
        ours = median.get((model, what, "troupe"))
        theirs = median.get((model, what.replace("_first", "").replace("_exact", ""),
                            "llama.cpp"))
        if ours is None or theirs is None:
            continue
        floor = median.get((model, what, "floor"))
        # tokens/s: higher is better; seconds and MiB: the ratio is troupe's over llama.cpp's.
        print(f"{os.path.basename(model)[:34]:34} {what:16} {ours:8.1f} {theirs:9.1f} "
              f"{ours / theirs:6.2f} {floor if floor else float('nan'):7.1f}")
PY
