#!/usr/bin/env bash
# How far each engine's next-token distributions are from the float32 reference on the same
# GGUF file: transformers on the file's weights dequantized (scripts/make-kld-base.py),
# written in llama.cpp's log-probability file, against which troupe's exact and fast paths
# (`troupe perplexity --kl-divergence-base`) and llama.cpp (`llama-perplexity
# --kl-divergence`, built natively) measure themselves over the same tokens: KL divergence
# (mean ± standard error, 99th percentile) and how often the most likely token is the
# reference's. Prints one JSON object per engine and model, then a table.
#
#   bash scripts/fidelity.sh [--chunks N] [--ctx N] [MODEL.gguf ...]
#
# The text is this checkout's README.md and docs/design-notes.md, tokenized by each model's
# own tokenizer; N chunks of ctx tokens (8 of 512), the second half of each scored (as
# llama-perplexity scores). Without files it measures the models of
# scripts/llamacpp-lib.sh. The reference needs torch, transformers, gguf and accelerate: a
# virtual environment made once in $TROUPE_REF_VENV (default ~/.cache/troupe/venv-ref).
set -euo pipefail
cd "$(dirname "$0")/.."

chunks=8
ctx=512
models=()
while [ $# -gt 0 ]; do
  case $1 in
    --chunks) chunks=$2; shift 2 ;;
    --ctx) ctx=$2; shift 2 ;;
    *) models+=("$1"); shift ;;
  esac
done
source scripts/llamacpp-lib.sh
build_llamacpp
[ ${#models[@]} -eq 0 ] && default_models

venv=${TROUPE_REF_VENV:-$HOME/.cache/troupe/venv-ref}
if ! "$venv/bin/python" -c "import torch, transformers, gguf, accelerate" 2> /dev/null; then
  echo "fidelity: making the reference's Python environment in $venv (once)" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet torch transformers gguf accelerate numpy >&2
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat README.md docs/design-notes.md > "$work/text.txt"
results=$work/results.jsonl
for model in "${models[@]}"; do
  name=$(basename "$model")
  # The tokens (each chunk as troupe computes it; the quicker path, only the tokens are
  # kept), then the reference on them.
  "$troupe" perplexity --model "$model" --file "$work/text.txt" --ctx "$ctx" \
    --chunks "$chunks" --cpu-precision fast --save-logits "$work/tokens.kld" --json > /dev/null
  "$venv/bin/python" scripts/make-kld-base.py "$model" --tokens-from "$work/tokens.kld" \
    --out "$work/reference.kld" > /dev/null 2>&1
  rm -f "$work/tokens.kld"
  for precision in exact fast; do
    "$troupe" perplexity --model "$model" --kl-divergence-base "$work/reference.kld" \
      --cpu-precision "$precision" --json | tail -1 | python3 -c 'import json, sys
d = json.load(sys.stdin)
print(json.dumps({"model": sys.argv[1], "engine": "troupe " + sys.argv[2],
                  **{k: d[k] for k in ("positions", "mean_kld", "kld_uncertainty", "kld_99",
                                       "same_top", "ppl", "ppl_base")}}))' "$name" "$precision"
  done
  "$bin/llama-perplexity" -m "$model" --kl-divergence-base "$work/reference.kld" \
    --kl-divergence -c "$ctx" -b "$ctx" -t "$threads" 2>&1 | python3 -c 'import json, re, sys
text = sys.stdin.read()
def value(label):
    m = re.search(re.escape(label) + r"\s*:\s*(-?[0-9.]+)(?:\s*±\s*([0-9.]+))?", text)
    if not m:
        sys.exit("fidelity: llama-perplexity printed no " + label + ":\n" + text[-2000:])
    return float(m.group(1)), float(m.group(2) or 0)
kld, error = value("Mean    KLD")
print(json.dumps({"model": sys.argv[1], "engine": "llama.cpp",
                  "positions": int(sys.argv[2]), "mean_kld": kld, "kld_uncertainty": error,
                  "kld_99": value("99.0%   KLD")[0], "same_top": value("Same top p")[0] / 100,
                  "ppl": value("Mean PPL(Q)")[0], "ppl_base": value("Mean PPL(base)")[0]}))' \
    "$name" $((chunks * (ctx - 1 - ctx / 2)))
  rm -f "$work/reference.kld"
done | tee "$results"

python3 - "$results" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print(f"\n{'model':34} {'engine':13} {'mean KLD':>19} {'99% KLD':>9} {'same top':>8} "
      f"{'PPL':>8} {'PPL ref':>8}")
for r in rows:
    kld = f"{r['mean_kld']:.6f} ± {r['kld_uncertainty']:.6f}"
    print(f"{r['model'][:34]:34} {r['engine']:13} {kld:>19} {r['kld_99']:9.5f} "
          f"{100 * r['same_top']:7.2f}% {r['ppl']:8.3f} {r['ppl_base']:8.3f}")
PY
