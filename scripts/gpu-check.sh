#!/usr/bin/env bash
# The GPU checks, for a machine with an NVIDIA GPU (sized for one lease of the device
# machine: well under 8 minutes). Configures and builds with CUDA for sm_90, runs the gpu
# test suites, and prints a short table last.
#
#   bash scripts/gpu-check.sh [BUILD_DIR]
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
cmake --build "$build" -j"$(nproc)" --target troupe test_cuda troupe_cli > "$log/build.txt" 2>&1 \
  || { grep -E "error" -A3 "$log/build.txt" | head -60; exit 1; }
built=$(date +%s)

(cd "$build" && ctest -L gpu -V --timeout 300) > "$log/ctest.txt" 2>&1
ctest_rc=$?
tested=$(date +%s)
grep -E "Test +#|Passed|Failed|Skipped|ERROR|CHECK" "$log/ctest.txt" | tail -40
# The GPU benchmarks: level-1 sleep and wake against plain pinned copies of the same bytes.
"$build/troupe" bench sleep --device cuda --gib 4 --cycles 3 --json > "$log/sleep.json" 2>&1 \
  || tail -5 "$log/sleep.json"
# The figures the suites print (doctest MESSAGE lines).
grep -E "MESSAGE:" "$log/ctest.txt" | sed 's/^.*MESSAGE: //' > "$log/figures.txt" || true

echo
echo "== gpu-check =="
printf "%-28s %s\n" "build (s)" "$((built - start))"
printf "%-28s %s\n" "ctest -L gpu (s)" "$((tested - built))"
printf "%-28s %s\n" "ctest -L gpu" "$(grep -E 'tests passed' "$log/ctest.txt" || echo FAILED)"
sed 's/^/figure: /' "$log/figures.txt"
printf "%-28s %s\n" "bench sleep (4 GiB)" "$(tail -1 "$log/sleep.json")"
exit $ctest_rc
