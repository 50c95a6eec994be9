#!/usr/bin/env bash
# Installs the build in $1 into a fresh prefix, then builds and runs the host application in
# $2 as a separate CMake project that finds troupe with find_package.
set -euo pipefail
build_dir=$1
app_dir=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build_dir" --prefix "$work/prefix" > "$work/install.log"
cmake -S "$app_dir" -B "$work/app" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$work/prefix" > "$work/configure.log"
cmake --build "$work/app" -j2 > "$work/build.log"
"$work/app/host_app"
