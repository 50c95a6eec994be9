#!/usr/bin/env bash
# The demo as a test: scripts/demo-generate.sh with --temperature 0 must exit 0 and answer
# the capital-of-France prompt with Paris. Exits 77 (skipped) when SmolLM2 is not in the
# model cache. Arguments: the troupe binary, the source tree.
set -uo pipefail
export TROUPE_BIN=$1
source_dir=$2
cache=${TROUPE_MODEL_CACHE:-$HOME/.cache/troupe/models}
model=$cache/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$model" ]; then
  echo "skipped: $model is not in the model cache (scripts/fetch-smollm2.sh fetches it)"
  exit 77
fi
out=$(bash "$source_dir/scripts/demo-generate.sh" "$model" --temperature 0)
status=$?
echo "$out"
if [ $status -ne 0 ]; then
  echo "FAILED: the demo exited with $status"
  exit 1
fi
answer=$(printf '%s\n' "$out" | awk '/^prompt: What is the capital of France\?$/ { getline; print; exit }')
case "$answer" in
  "output: "*Paris*) echo "the demo answered: ${answer#output: }" ;;
  *) echo "FAILED: the answer to the capital-of-France prompt does not name Paris: '$answer'"
     exit 1 ;;
esac
