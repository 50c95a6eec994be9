#!/usr/bin/env bash
# The GPU checks, for a machine with an NVIDIA GPU (sized for one lease of the device
# machine: well under 8 minutes). Runs the gpu test suites (kernels against the CPU's, the
# models against transformers and the CPU, sleep/wake, gpu_memory_utilization, NCCL), then
# the GPU benchmarks, and prints a short table last.
#
#   bash scripts/gpu-check.sh [--stage] [BUILD_DIR]
#
# BUILD_DIR (default build-gpu) also keeps what the device tool's calls carried, so that a
# warm machine has it in the next call; --stage only stores this call's parts there (see
# scripts/gpu-bundle.sh for the two calls).
#
# Two ways to get the binaries ($GPU_CHECK_MODE=bundle|build forces one):
# - where troupe's dependencies are installed, it configures and builds with CUDA for sm_90;
# - elsewhere (the device tool's machines have CUDA but no CAF and no network) it runs the
#   bundle scripts/gpu-bundle.sh made: carry `.gpu-bundle` with the call.
#
# SmolLM2-135M's real weights (the 95 MB GGUF the demo fetches) are used where
# $TROUPE_MODEL_CACHE (default ~/.cache/troupe/models) holds them; elsewhere that test says
# it skipped and the decode benchmark runs a random-weight model of SmolLM2's shape, which
# reads the same bytes.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
stage_only=0
if [ "${1:-}" = --stage ]; then
  stage_only=1
  shift
fi
build=${1:-$root/build-gpu}
log=$(mktemp -d)

# What this call carried joins what earlier calls left in the build folder.
mkdir -p "$build"
for file in .gpu-bundle/bundle.tar.xz .gpu-bundle/smollm2.part1 .gpu-model/smollm2.part2 \
            .gpu-model/smollm2.sha256; do
  [ -f "$root/$file" ] && cp "$root/$file" "$build/"
done
if [ $stage_only = 1 ]; then
  ls -la "$build"
  exit 0
fi
bundle=$build/bundle.tar.xz
if [ -f "$build/smollm2.part1" ] && [ -f "$build/smollm2.part2" ]; then
  mkdir -p "$build/models"
  cat "$build/smollm2.part1" "$build/smollm2.part2" \
    > "$build/models/SmolLM2-135M-Instruct.Q4_1.gguf"
  if [ "$(sha256sum < "$build/models/SmolLM2-135M-Instruct.Q4_1.gguf" | cut -d' ' -f1)" \
       = "$(cat "$build/smollm2.sha256" 2> /dev/null)" ]; then
    export TROUPE_MODEL_CACHE=$build/models
  else
    echo "gpu-check: the SmolLM2 parts do not make the file they were cut from" >&2
  fi
fi

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
  timeout 300 "$suite" > "$log/$name.txt" 2>&1
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
bench_step() { # DTYPE BATCH [--enforce-eager]
  timeout 120 "$troupe" bench step --model "$model" --device cuda --dtype "$1" --batch "$2" \
    --prompt-len 64 --decode-steps 64 --gpu-memory-utilization 0.5 --json ${3:-} \
    2> "$log/step.err" | tail -1 >> "$log/step.json" || tail -5 "$log/step.err"
}
for batch in 1 32; do
  bench_step bfloat16 $batch
  bench_step bfloat16 $batch --enforce-eager
  bench_step float32 $batch
done
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
python3 - "$log/step.json" "$log/sleep.json" <<'PY'
import json, sys
def results(path):
    for line in open(path):
        try:
            yield json.loads(line)
        except ValueError:
            pass  # a log line, not the JSON result
steps = list(results(sys.argv[1]))
for r in steps:
    mode = "eager" if r.get("enforce_eager") else "graphs"
    print(f"decode {r['dtype']:>8} {mode:>6} batch {r['batch']:>2}: "
          f"{r['decode_tokens_per_s']:9.0f} tok/s, "
          f"{r['decode_step_ms']:.3f} ms/step; floor {r['bandwidth_floor_step_ms']:.3f} ms "
          f"({r['weight_bytes'] / 1e6:.0f} MB at {r['read_bytes_per_s'] / 1e9:.0f} GB/s)")
if not steps:
    print("decode: no result")
for s in list(results(sys.argv[2]))[-1:] or [None]:
    if s is None:
        print("sleep: no result")
        continue
    print(f"sleep(1) {s['sleep_gbps']:.1f} GB/s, wake {s['wake_gbps']:.1f} GB/s; pinned copies "
          f"{s['copy_to_host_gbps']:.1f} GB/s down, {s['copy_to_device_gbps']:.1f} GB/s up; "
          f"returned {s['returned_fraction'] * 100:.1f} %")
PY
exit $status
