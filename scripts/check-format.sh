#!/usr/bin/env bash
# Checks that every C++ file of the repository is formatted as .clang-format says; prints
# the files that are not and exits 1. `--fix` formats them in place instead.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v clang-format > /dev/null; then
  echo "check-format: clang-format is missing (scripts/setup-deps.sh installs it)" >&2
  exit 1
fi
mapfile -t files < <(git ls-files '*.cpp' '*.hpp' '*.cu' '*.inc')
if [[ ${1:-} == --fix ]]; then
  clang-format -i "${files[@]}"
  exit 0
fi
status=0
for f in "${files[@]}"; do
  if ! clang-format --dry-run --Werror "$f" > /dev/null 2>&1; then
    echo "not formatted: $f (scripts/check-format.sh --fix)"
    status=1
  fi
done
if ((status == 0)); then
  echo "format: ${#files[@]} files as .clang-format says"
fi
exit $status
