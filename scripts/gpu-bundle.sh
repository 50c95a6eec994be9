#!/usr/bin/env bash
# Builds the GPU checks here (CUDA for sm_90, Release) and packs them for a GPU machine
# that has CUDA but none of troupe's other dependencies and no network (the device tool's
# machines): the test and benchmark binaries, libtroupe and its CUDA module (opened from
# beside it), and every shared library they need beyond glibc, libstdc++ and CUDA's own, as
# .gpu-bundle/bundle.tar.xz (git ignores it; the device tool carries it). scripts/gpu-check.sh there runs from the bundle.
#
#   bash scripts/gpu-bundle.sh [BUILD_DIR]
#
# Then, through the device tool:
#   run(command="bash scripts/gpu-check.sh", carry=[".gpu-bundle"])
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build-gpu}
out=$root/.gpu-bundle
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT

cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DTROUPE_WITH_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DTROUPE_BUILD_EXAMPLES=OFF > /dev/null
cmake --build "$build" -j"$(nproc)" --target troupe troupe_cuda test_cuda test_gpu_model troupe_cli

mkdir -p "$stage/bin" "$stage/lib"
binaries=("$build/tests/test_cuda" "$build/tests/test_gpu_model" "$build/troupe")
cp "${binaries[@]}" "$stage/bin/"
cp "$build/libtroupe.so" "$build/libtroupe_cuda.so" "$stage/lib/"
# The libraries the GPU machine lacks: everything but the C and C++ runtimes and CUDA's own
# (cudart, cuBLAS, NCCL), which its image has in the versions of its driver.
ldd "${binaries[@]}" "$build/libtroupe.so" "$build/libtroupe_cuda.so" | awk '$3 ~ /^\// {print $1, $3}' | sort -u |
  while read -r name path; do
    case "$name" in
      libc.so.*|libm.so.*|libdl.so.*|libpthread.so.*|librt.so.*|libgcc_s.so.*|libstdc++.so.*) ;;
      libtroupe.so|libtroupe_cuda.so) ;;
      libcudart.so.*|libcublas.so.*|libcublasLt.so.*|libnccl.so.*) ;;
      *) cp -L "$path" "$stage/lib/$name" ;;
    esac
  done
rm -rf "$out"
mkdir -p "$out"
tar -C "$stage" -cJf "$out/bundle.tar.xz" bin lib
ls -la "$out"
