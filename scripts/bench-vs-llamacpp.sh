#!/usr/bin/env bash
# troupe next to llama.cpp on the same GGUF file and the same number of threads, in one run:
# batch-1 decode and 64-token prefill, decode at tensor parallel size 2, batched decode of
# 32 sequences, the same batch-1 decode on an F16 copy of the file (made by llama.cpp's own
# quantizer), and the start-up of a whole process that generates one token (time and peak
# memory). llama.cpp runs through llama-cpp-python, which builds it from source into a
# throwaway venv. Prints a JSON object per measurement, then a table with the ratios. A
# benchmark, not a test: it takes minutes (the llama.cpp build alone, once per venv).
#
#   bash scripts/bench-vs-llamacpp.sh [MODEL.gguf]      (default: SmolLM2-135M Q4_1)
#
# TROUPE_BENCH_VENV keeps the venv (default: a fresh one under /tmp, removed at the end).
set -euo pipefail
cd "$(dirname "$0")/.."

model=${1:-$(bash scripts/fetch-smollm2.sh)}
troupe=${TROUPE_BIN:-build/troupe}
threads=$(nproc)
work=$(mktemp -d)
venv=${TROUPE_BENCH_VENV:-}
if [ -z "$venv" ]; then
  venv=$work/venv
fi
trap 'rm -rf "$work"' EXIT
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
if ! "$venv/bin/python" -c "import llama_cpp" 2> /dev/null; then
  echo "bench-vs-llamacpp: building llama-cpp-python (llama.cpp from source; minutes)" >&2
  CMAKE_BUILD_PARALLEL_LEVEL=$threads "$venv/bin/pip" install --quiet llama-cpp-python >&2
fi
py() { "$venv/bin/python" "$@"; }

# The F16 copy: llama.cpp's quantizer writes every weight of the file as float16.
f16=$work/model-f16.gguf
py - "$model" "$f16" <<'PY' 2> /dev/null
import sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = 1  # LLAMA_FTYPE_MOSTLY_F16
params.allow_requantize = True
if llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params) != 0:
    sys.exit("bench-vs-llamacpp: llama.cpp could not write an F16 copy")
PY

# llama.cpp: best of three runs of each shape, on all the cores. Batch 1: a 64-token
# prefill, then 64 decode steps. Batch 32: 32 sequences of 16 prompt tokens in one batch,
# then 64 steps of one token for each.
llama() { # $1: model file; $2: "batched" for the batch-32 figure as well
  py - "$1" "$threads" "${2:-}" <<'PY' 2> /dev/null
import json, sys, time
import llama_cpp
path, threads, batched = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "batched"
llama_cpp.llama_backend_init()
model = llama_cpp.llama_model_load_from_file(path.encode(), llama_cpp.llama_model_default_params())
cp = llama_cpp.llama_context_default_params()
cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 32 * 128, 512, 512, 32
cp.n_threads = cp.n_threads_batch = threads
cp.kv_unified = True
ctx = llama_cpp.llama_init_from_model(model, cp)
batch = llama_cpp.llama_batch_init(512, 0, 32)

def decode(entries):  # (token, position, sequence, wants logits)
    batch.n_tokens = len(entries)
    for i, (token, pos, seq, logits) in enumerate(entries):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
        batch.seq_id[i][0], batch.logits[i] = seq, logits
    if llama_cpp.llama_decode(ctx, batch) != 0:
        sys.exit("llama_decode failed")

def run(seqs, prompt_len, steps):
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
    prompt = [(i * 7919) % 1000 + 100 for i in range(prompt_len)]
    start = time.perf_counter()
    decode([(t, p, s, p == prompt_len - 1) for s in range(seqs) for p, t in enumerate(prompt)])
    prefill = seqs * prompt_len / (time.perf_counter() - start)
    start = time.perf_counter()
    for step in range(steps):
        decode([(prompt[-1], prompt_len + step, s, True) for s in range(seqs)])
    return prefill, seqs * steps / (time.perf_counter() - start)

best = {"engine": "llama.cpp", "model": path, "threads": threads,
        "prefill_tokens_per_s": 0.0, "decode_tokens_per_s": 0.0}
if batched:
    best["batch32_decode_tokens_per_s"] = 0.0
for _ in range(3):
    prefill, decode1 = run(1, 64, 64)
    best["prefill_tokens_per_s"] = max(best["prefill_tokens_per_s"], prefill)
    best["decode_tokens_per_s"] = max(best["decode_tokens_per_s"], decode1)
    if batched:
        best["batch32_decode_tokens_per_s"] = max(best["batch32_decode_tokens_per_s"],
                                                  run(32, 16, 64)[1])
print(json.dumps(best))
PY
}
llama_json=$(llama "$model" batched)
llama_f16=$(llama "$f16")
echo "$llama_json"
echo "$llama_f16"

# troupe: the same shapes, best of three runs.
best() { # troupe bench step options
  local out="" run
  for _ in 1 2 3; do
    run=$("$troupe" bench step --json "$@" 2> /dev/null | tail -1)
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
tp1=$(best --model "$model" --batch 1 --prompt-len 64 --decode-steps 64)
tp2=$(best --model "$model" --batch 1 --prompt-len 64 --decode-steps 64 --tensor-parallel-size 2)
b32=$(best --model "$model" --batch 32 --prompt-len 16 --decode-steps 64)
tf16=$(best --model "$f16" --batch 1 --prompt-len 64 --decode-steps 64)
for j in "$tp1" "$tp2" "$b32" "$tf16"; do echo "$j"; done

# Start-up: a whole process that loads the model and generates one token.
startup() { # the command; prints seconds and peak resident KiB
  /usr/bin/time -f "%e %M" "$@" > /dev/null 2> "$work/time" || true
  tail -1 "$work/time"
}
troupe_start=$(startup "$troupe" generate --model "$model" --prompt "Hello" --max-tokens 1)
llama_start=$(startup "$venv/bin/python" -c "
import llama_cpp, sys
llm = llama_cpp.Llama(model_path='$model', n_ctx=512, n_threads=$threads, verbose=False)
llm.create_completion('Hello', max_tokens=1)")
echo "{\"startup\":\"troupe\",\"seconds\":${troupe_start% *},\"peak_kib\":${troupe_start#* }}"
echo "{\"startup\":\"llama.cpp\",\"seconds\":${llama_start% *},\"peak_kib\":${llama_start#* }}"

python3 - "$llama_json" "$llama_f16" "$tp1" "$tp2" "$b32" "$tf16" "$troupe_start" \
          "$llama_start" <<'PY'
import json, sys
llama, llama_f16, tp1, tp2, b32, tf16 = (json.loads(x) for x in sys.argv[1:7])
ts, tk = (x.split() for x in sys.argv[7:9])
rows = [
    ("decode, batch 1, tok/s", tp1["decode_tokens_per_s"], llama["decode_tokens_per_s"]),
    ("prefill 64, tok/s", tp1["prefill_tokens_per_s"], llama["prefill_tokens_per_s"]),
    ("decode TP 2 (llama.cpp: 1), tok/s", tp2["decode_tokens_per_s"],
     llama["decode_tokens_per_s"]),
    ("decode, batch 32, tok/s", b32["decode_tokens_per_s"],
     llama["batch32_decode_tokens_per_s"]),
    ("decode, batch 1, F16 copy, tok/s", tf16["decode_tokens_per_s"],
     llama_f16["decode_tokens_per_s"]),
    ("start-up, s (lower is better)", float(ts[0]), float(tk[0])),
    ("start-up peak, MiB (lower is better)", int(ts[1]) / 1024, int(tk[1]) / 1024),
]
print(f"{'':38} {'troupe':>10} {'llama.cpp':>10} {'ratio':>7}")
for name, ours, theirs in rows:
    print(f"{name:38} {ours:10.2f} {theirs:10.2f} {ours / theirs:7.2f}")
print(f"{'TP 2 step time / TP 1 step time':38} "
      f"{tp1['decode_tokens_per_s'] / tp2['decode_tokens_per_s']:10.2f}")
PY
