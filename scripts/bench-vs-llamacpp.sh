#!/usr/bin/env bash
# troupe next to llama.cpp on the same GGUF file and the same number of threads: batch-1
# decode and 64-token prefill tokens/s (troupe bench step against llama.cpp through
# llama-cpp-python, which builds llama.cpp from source into a throwaway venv), and the
# start-up of a whole process that generates one token (time and peak memory). Prints a
# JSON object per figure, then a table with the ratios. A benchmark, not a test: it takes
# minutes (the llama.cpp build alone, once per venv).
#
#   bash scripts/bench-vs-llamacpp.sh [MODEL.gguf]      (default: SmolLM2-135M Q4_1)
#
# TROUPE_BENCH_VENV keeps the venv (default: a fresh one under /tmp, removed at the end).
set -euo pipefail
cd "$(dirname "$0")/.."

model=${1:-$(bash scripts/fetch-smollm2.sh)}
troupe=${TROUPE_BIN:-build/troupe}
threads=$(nproc)
venv=${TROUPE_BENCH_VENV:-}
if [ -z "$venv" ]; then
  venv=$(mktemp -d)
  trap 'rm -rf "$venv"' EXIT
fi
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
if ! "$venv/bin/python" -c "import llama_cpp" 2> /dev/null; then
  echo "bench-vs-llamacpp: building llama-cpp-python (llama.cpp from source; minutes)" >&2
  CMAKE_BUILD_PARALLEL_LEVEL=$threads "$venv/bin/pip" install --quiet llama-cpp-python >&2
fi

# llama.cpp: 64-token prefill, then 64 decode steps of one token, on all the cores.
llama_json=$("$venv/bin/python" - "$model" "$threads" <<'PY'
import json, sys, time
import llama_cpp
model, threads = sys.argv[1], int(sys.argv[2])
llm = llama_cpp.Llama(model_path=model, n_ctx=512, n_batch=64, n_threads=threads,
                      n_threads_batch=threads, verbose=False)
prompt = [(i * 7919) % 1000 + 100 for i in range(64)]
best_prefill, best_decode = 0.0, 0.0
for _ in range(3):
    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt)
    prefill = 64 / (time.perf_counter() - start)
    token = prompt[-1]
    start = time.perf_counter()
    for _ in range(64):
        llm.eval([token])
    decode = 64 / (time.perf_counter() - start)
    best_prefill, best_decode = max(best_prefill, prefill), max(best_decode, decode)
print(json.dumps({"engine": "llama.cpp", "threads": threads,
                  "prefill_tokens_per_s": best_prefill, "decode_tokens_per_s": best_decode}))
PY
)
echo "$llama_json"

# troupe: the same shapes, best of three runs.
best() { # $1: tensor parallel size
  local out="" run
  for _ in 1 2 3; do
    run=$("$troupe" bench step --model "$model" --batch 1 --prompt-len 64 --decode-steps 64 \
            --tensor-parallel-size "$1" --json 2> /dev/null | tail -1)
    out=$(python3 -c 'import json,sys
a, b = sys.argv[1], json.loads(sys.argv[2])
if a:
    a = json.loads(a)
    for k in ("prefill_tokens_per_s", "decode_tokens_per_s"):
        b[k] = max(a[k], b[k])
print(json.dumps(b))' "$out" "$run")
  done
  echo "$out"
}
tp1=$(best 1)
tp2=$(best 2)
echo "$tp1"
echo "$tp2"

# Start-up: a whole process that loads the model and generates one token.
startup() { # the command; prints seconds and peak resident KiB
  /usr/bin/time -f "%e %M" "$@" > /dev/null 2> /tmp/troupe-bench-time.$$ || true
  tail -1 /tmp/troupe-bench-time.$$
  rm -f /tmp/troupe-bench-time.$$
}
troupe_start=$(startup "$troupe" generate --model "$model" --prompt "Hello" --max-tokens 1)
llama_start=$(startup "$venv/bin/python" -c "
import llama_cpp, sys
llm = llama_cpp.Llama(model_path='$model', n_ctx=512, n_threads=$threads, verbose=False)
llm.create_completion('Hello', max_tokens=1)")
echo "{\"startup\":\"troupe\",\"seconds\":${troupe_start% *},\"peak_kib\":${troupe_start#* }}"
echo "{\"startup\":\"llama.cpp\",\"seconds\":${llama_start% *},\"peak_kib\":${llama_start#* }}"

python3 - "$llama_json" "$tp1" "$tp2" "$troupe_start" "$llama_start" <<'PY'
import json, sys
llama, tp1, tp2 = (json.loads(x) for x in sys.argv[1:4])
ts, tk = (x.split() for x in sys.argv[4:6])
rows = [
    ("decode, batch 1, tok/s", tp1["decode_tokens_per_s"], llama["decode_tokens_per_s"]),
    ("prefill 64, tok/s", tp1["prefill_tokens_per_s"], llama["prefill_tokens_per_s"]),
    ("decode TP 2, tok/s", tp2["decode_tokens_per_s"], llama["decode_tokens_per_s"]),
    ("start-up, s (lower is better)", float(ts[0]), float(tk[0])),
    ("start-up peak, MiB (lower is better)", int(ts[1]) / 1024, int(tk[1]) / 1024),
]
print(f"{'':38} {'troupe':>10} {'llama.cpp':>10} {'ratio':>7}")
for name, ours, theirs in rows:
    print(f"{name:38} {ours:10.1f} {theirs:10.1f} {ours / theirs:7.2f}")
PY
