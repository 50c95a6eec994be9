#!/usr/bin/env bash
# The GPU checks, for a machine with an NVIDIA GPU (sized for one lease of the device
# machine: well under 8 minutes). Runs the gpu test suites (kernels against the CPU's, the
# models against transformers and the CPU, sleep/wake, gpu_memory_utilization, NCCL), then
# the GPU benchmarks, and prints a short table last.
#
#   bash scripts/gpu-check.sh [BUILD_DIR]
#
# Two ways to get the binaries ($GPU_CHECK_MODE=bundle|build forces one):
# - where troupe's dependencies are installed, it configures and builds with CUDA for sm_90
#   in BUILD_DIR (default build-gpu);
# - elsewhere (the device tool's machines have CUDA but no CAF and no network) it runs the
#   bundle scripts/gpu-bundle.sh made: carry `.gpu-bundle` with the call.
#
# SmolLM2-135M's real weights (the 95 MB GGUF the demo fetches) are used where
# $TROUPE_MODEL_CACHE (default ~/.cache/troupe/models) holds them; elsewhere that test says
# it skipped and the decode benchmark runs a random-weight model of SmolLM2's shape, which
# reads the same bytes. (The device tool carries 64 MiB a call with the working tree, which
# is 22 MB: the bundle fits beside it, the GGUF does not.)
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build-gpu}
log=$(mktemp -d)
bundle=$root/.gpu-bundle/bundle.tar.xz

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
start=$(date +%s)
mode=${GPU_CHECK_MODE:-}
if [ -z "$mode" ]; then
  mode=build
  [ -f "$bundle" ] && ! dpkg-query -W libcaf-dev > /dev/null 2>&1 && mode=bundle
fi
if [ "$mode" = bundle ]; then
  bin=$log/bundle/bin
  mkdir -p "$log/bundle"
  tar -C "$log/bundle" -xJf "$bundle" 2> /dev/null \
    || python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
      "$bundle" "$log/bundle" || exit 1
  # CUDA's own libraries, wherever this machine keeps them: the toolkit's first (so that
  # cuBLAS and cuBLASLt come from one place), then Python wheels (NCCL).
  cuda_dirs=$(for where in /usr/local/cuda* /usr/local /usr/lib /opt; do
      find "$where" \( -name 'libcudart.so.13' -o -name 'libcublas.so.13' \
        -o -name 'libcublasLt.so.13' -o -name 'libnccl.so.2' \) 2> /dev/null
    done | xargs -r -n1 dirname | awk '!seen[$0]++' | paste -sd:)
  export LD_LIBRARY_PATH=$log/bundle/lib:$cuda_dirs:${LD_LIBRARY_PATH:-}
  export TROUPE_SOURCE_DIR=$root
  if ldd "$bin"/* | grep "not found"; then
    echo "gpu-check: the bundle's binaries miss the libraries above" >&2
    exit 1
  fi
  suites=("$bin/test_cuda" "$bin/test_gpu_model")
else
  bin=$build
  if ! dpkg-query -W libcaf-dev > /dev/null 2>&1; then
    bash "$root/scripts/setup-deps.sh" || { echo "gpu-check: dependencies missing" >&2; exit 1; }
  fi
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DTROUPE_WITH_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DTROUPE_BUILD_EXAMPLES=OFF > "$log/configure.txt" 2>&1 \
    || { tail -30 "$log/configure.txt"; exit 1; }
  cmake --build "$build" -j"$(nproc)" --target troupe test_cuda test_gpu_model troupe_cli \
    > "$log/build.txt" 2>&1 || { grep -E "error" -A3 "$log/build.txt" | head -60; exit 1; }
  suites=("$build/tests/test_cuda" "$build/tests/test_gpu_model")
fi
built=$(date +%s)

# The suites, each on its own. Exit code 77: nothing failed and some cases were skipped
# (each printed "skipped: <reason>"; without a GPU, all of them).
status=0
summary=""
for suite in "${suites[@]}"; do
  name=$(basename "$suite")
  timeout 150 "$suite" > "$log/$name.txt" 2>&1
  rc=$?
  skips=$(grep -c "^skipped: " "$log/$name.txt")
  [ $rc -ne 0 ] && [ $rc -ne 77 ] && status=1
  summary+="$name: $( [ $rc -eq 0 ] && echo passed || ([ $rc -eq 77 ] && echo "no failure, $skips case(s) skipped" || echo "FAILED ($rc)")); "
  grep -E "ERROR|CHECK|FAILED|skipped|test cases:" "$log/$name.txt" | tail -40
done
tested=$(date +%s)

# Decode at batch 1 and 32 on a model of SmolLM2-135M's size, in bf16 (with CUDA graphs and
# without) and float32, next to the floor of reading every weight once at the GPU's copy
# bandwidth.
troupe=$bin/troupe
model=$log/smollm2-shape
cache=${TROUPE_MODEL_CACHE:-$HOME/.cache/troupe/models}
if [ -f "$cache/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
  model=$cache/SmolLM2-135M-Instruct.Q4_1.gguf
else
  "$troupe" make-model --preset smollm2-135m --dtype bf16 --out "$model" > /dev/null
fi
: > "$log/step.json"
bench_step() { # MODEL DTYPE BATCH [--enforce-eager]
  timeout 120 "$troupe" bench step --model "$1" --device cuda --dtype "$2" --batch "$3" \
    --prompt-len 64 --decode-steps 64 --gpu-memory-utilization 0.5 --json ${4:-} \
    2> "$log/step.err" | tail -1 >> "$log/step.json" || tail -5 "$log/step.err"
}
for batch in 1 32; do
  bench_step "$model" bfloat16 $batch
  bench_step "$model" bfloat16 $batch --enforce-eager
  bench_step "$model" float32 $batch
done
# The same at Llama 3.2 1B's shape (random bf16 weights, 2.5 GB).
big=$log/llama-1b-shape
"$troupe" make-model --layers 16 --hidden 2048 --heads 32 --kv-heads 8 --intermediate 8192 \
  --vocab 128256 --tie --dtype bf16 --out "$big" > /dev/null
for batch in 1 32; do
  bench_step "$big" bfloat16 $batch
done
bench_step "$big" bfloat16 1 --enforce-eager
# The executor's own part of a step: execute_model through the driver and the execution
# loop to one worker that computes nothing.
timeout 60 "$troupe" bench rpc --workers 1 --method execute_model --iterations 1000 \
  --idle-seconds 1 --json 2> /dev/null | tail -1 > "$log/rpc.json"
# Level-1 sleep and wake against plain pinned copies of the same bytes.
timeout 120 "$troupe" bench sleep --device cuda --gib 4 --cycles 3 --json > "$log/sleep.json" \
  2>&1 || tail -5 "$log/sleep.json"
# The figures the suites print (doctest MESSAGE lines).
cat "$log"/test_*.txt | grep -E "MESSAGE:" | sed 's/^.*MESSAGE: //' > "$log/figures.txt" || true

echo
echo "== gpu-check ($mode) =="
printf "%-20s %s\n" "build (s)" "$((built - start))"
printf "%-20s %s\n" "gpu suites (s)" "$((tested - built))"
printf "%-20s %s\n" "gpu suites" "$summary"
sed 's/^/figure: /' "$log/figures.txt"
python3 - "$log/step.json" "$log/sleep.json" "$log/rpc.json" <<'PY'
import json, os, sys
def results(path):
    for line in open(path):
        try:
            yield json.loads(line)
        except ValueError:
            pass  # a log line, not the JSON result
steps = list(results(sys.argv[1]))
for r in steps:
    mode = "eager" if r.get("enforce_eager") else "graphs"
    shape = "1B" if "llama-1b" in r["model"] else "135M"
    print(f"decode {shape:>4} {r['dtype']:>8} {mode:>6} batch {r['batch']:>2}: "
          f"{r['decode_tokens_per_s']:9.0f} tok/s, "
          f"{r['decode_step_ms']:.3f} ms/step; floor {r['bandwidth_floor_step_ms']:.3f} ms "
          f"({r['weight_bytes'] / 1e6:.0f} MB at {r['read_bytes_per_s'] / 1e9:.0f} GB/s)")
if not steps:
    print("decode: no result")
rpc = list(results(sys.argv[3]))
if rpc and steps:
    overhead_us = rpc[-1][0]["p50_us"]
    for r in steps:
        if r["batch"] == 1 and not r.get("enforce_eager") and r["dtype"] == "bfloat16":
            print(f"executor per step: {overhead_us:.1f} us p50 = "
                  f"{overhead_us / (r['decode_step_ms'] * 10):.2f} % of the "
                  f"{os.path.basename(r['model'])} bf16 batch-1 step")
else:
    print("executor per step: no result")
for s in list(results(sys.argv[2]))[-1:] or [None]:
    if s is None:
        print("sleep: no result")
        continue
    print(f"sleep(1) {s['sleep_gbps']:.1f} GB/s, wake {s['wake_gbps']:.1f} GB/s; pinned copies "
          f"{s['copy_to_host_gbps']:.1f} GB/s down, {s['copy_to_device_gbps']:.1f} GB/s up; "
          f"returned {s['returned_fraction'] * 100:.1f} %")
PY
# The logs, for the device tool's caller.
if [ -n "${OUT:-}" ]; then
  cp "$log"/test_*.txt "$log"/step.json "$log"/step.err "$log"/sleep.json "$log"/rpc.json \
    "$OUT"/ 2> /dev/null
fi
exit $status
