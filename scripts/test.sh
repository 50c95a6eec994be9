#!/usr/bin/env bash
# The project's test command: installs what is missing, configures a Release build in build/,
# builds with two jobs and runs the CPU test suite. Its exit code is the verdict.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DTROUPE_BUILD_TESTS=ON
cmake --build build -j2
cd build
ctest -LE gpu --output-on-failure --timeout 600
