#!/usr/bin/env bash
# The GPU checks, for a machine with an NVIDIA GPU (sized for one lease of the device
# machine: well under 8 minutes). Configures and builds with CUDA for sm_90, runs the gpu
# test suites (kernels against the CPU's, the models against transformers and the CPU,
# sleep/wake, gpu_memory_utilization, NCCL), then the GPU benchmarks, and prints a short
# table last.
#
#   bash scripts/gpu-check.sh [BUILD_DIR]
#
# SmolLM2-135M's real weights (the 95 MB GGUF the demo fetches) are used where
# $TROUPE_MODEL_CACHE (default ~/.cache/troupe/models) holds them; elsewhere that test says
# it skipped and the decode benchmark runs a random-weight model of SmolLM2's shape, which
# reads the same bytes.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build-gpu}
log=$(mktemp -d)

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
if ! dpkg-query -W libcaf-dev >/dev/null 2>&1; then
  bash "$root/scripts/setup-deps.sh" || { echo "gpu-check: dependencies missing" >&2; exit 1; }
fi

start=$(date +%s)
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DTROUPE_WITH_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DTROUPE_BUILD_EXAMPLES=OFF > "$log/configure.txt" 2>&1 \
  || { tail -30 "$log/configure.txt"; exit 1; }
cmake --build "$build" -j"$(nproc)" --target troupe test_cuda test_gpu_model troupe_cli \
  > "$log/build.txt" 2>&1 || { grep -E "error" -A3 "$log/build.txt" | head -60; exit 1; }
built=$(date +%s)

(cd "$build" && ctest -L gpu -V --timeout 300) > "$log/ctest.txt" 2>&1
ctest_rc=$?
tested=$(date +%s)
grep -E "Test +#|Passed|Failed|Skipped|ERROR|CHECK|skipped" "$log/ctest.txt" | tail -60

# Decode at batch 1 and 32 on a model of SmolLM2-135M's size, in bf16 and float32, next to
# the floor of reading every weight once at the GPU's copy bandwidth.
troupe=$build/troupe
model=$log/smollm2-shape
cache=${TROUPE_MODEL_CACHE:-$HOME/.cache/troupe/models}
if [ -f "$cache/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
  model=$cache/SmolLM2-135M-Instruct.Q4_1.gguf
else
  "$troupe" make-model --preset smollm2-135m --dtype bf16 --out "$model" > /dev/null
fi
: > "$log/step.json"
for dtype in bfloat16 float32; do
  for batch in 1 32; do
    timeout 120 "$troupe" bench step --model "$model" --device cuda --dtype "$dtype" \
      --batch "$batch" --prompt-len 64 --decode-steps 64 --gpu-memory-utilization 0.5 --json \
      2> "$log/step-$dtype-$batch.err" | tail -1 >> "$log/step.json" \
      || tail -5 "$log/step-$dtype-$batch.err"
  done
done
# Level-1 sleep and wake against plain pinned copies of the same bytes.
timeout 120 "$troupe" bench sleep --device cuda --gib 4 --cycles 3 --json > "$log/sleep.json" \
  2>&1 || tail -5 "$log/sleep.json"
# The figures the suites print (doctest MESSAGE lines).
grep -E "MESSAGE:" "$log/ctest.txt" | sed 's/^.*MESSAGE: //' > "$log/figures.txt" || true

echo
echo "== gpu-check =="
printf "%-28s %s\n" "build (s)" "$((built - start))"
printf "%-28s %s\n" "ctest -L gpu (s)" "$((tested - built))"
printf "%-28s %s\n" "ctest -L gpu" "$(grep -E 'tests passed' "$log/ctest.txt" || echo FAILED)"
sed 's/^/figure: /' "$log/figures.txt"
python3 - "$log/step.json" "$log/sleep.json" <<'PY' || cat "$log/step.json" "$log/sleep.json"
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"decode {r['dtype']:>8} batch {r['batch']:>2}: {r['decode_tokens_per_s']:9.0f} tok/s, "
          f"{r['decode_step_ms']:.3f} ms/step; floor {r['bandwidth_floor_step_ms']:.3f} ms "
          f"({r['weight_bytes'] / 1e6:.0f} MB at {r['memcpy_bytes_per_s'] / 1e9:.0f} GB/s)")
s = json.loads(open(sys.argv[2]).read().strip().splitlines()[-1])
print(f"sleep(1) {s['sleep_gbps']:.1f} GB/s, wake {s['wake_gbps']:.1f} GB/s; pinned copies "
      f"{s['copy_to_host_gbps']:.1f} GB/s down, {s['copy_to_device_gbps']:.1f} GB/s up; "
      f"returned {s['returned_fraction'] * 100:.1f} %")
PY
exit $ctest_rc
