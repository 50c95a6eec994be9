#!/usr/bin/env bash
# The demo's generation: two prompts answered by SmolLM2-135M-Instruct with two CPU workers
# in tensor parallel. Run by scripts/demo.sh and, with --temperature 0, by the test suite
# (tests/demo_test.sh). Arguments: the model file, then any extra `troupe generate` options.
# The troupe binary is $TROUPE_BIN, or build/troupe.
set -euo pipefail
model=$1
shift
"${TROUPE_BIN:-build/troupe}" generate --model "$model" --tensor-parallel-size 2 --chat \
  --max-tokens 64 \
  --prompt "What is the capital of France?" \
  --prompt "Give me three tips for learning a new language." \
  "$@"
