#!/usr/bin/env bash
# `troupe perplexity` end to end on SmolLM2: the text's perplexity with its log-probabilities
# saved, the exact path against that file (no divergence, the same top token everywhere),
# the fast path within the spec, and bad input refused in one line. Exits 77 (skipped) when
# SmolLM2 is not in the model cache. Arguments: the troupe binary, the source tree.
set -uo pipefail
troupe=$1
source_dir=$2
cache=${TROUPE_MODEL_CACHE:-$HOME/.cache/troupe/models}
model=$cache/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$model" ]; then
  echo "skipped: $model is not in the model cache (scripts/fetch-smollm2.sh fetches it)"
  exit 77
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAILED: $*"; exit 1; }

"$troupe" perplexity --model "$model" --file "$source_dir/README.md" --ctx 64 --chunks 3 \
  --cpu-precision exact --save-logits "$work/base.kld" --json > "$work/saved.json" ||
  fail "the first run failed"
"$troupe" perplexity --model "$model" --kl-divergence-base "$work/base.kld" \
  --cpu-precision exact --json > "$work/exact.json" ||
  fail "the exact run against the saved file failed"
"$troupe" perplexity --model "$model" --kl-divergence-base "$work/base.kld" \
  --cpu-precision fast --json > "$work/fast.json" || fail "the fast run failed"
python3 - "$work" <<'PY' || exit 1
import json, sys
saved, exact, fast = (json.loads(open(f"{sys.argv[1]}/{n}.json").read().splitlines()[-1])
                      for n in ("saved", "exact", "fast"))
print("saved:", saved, "\nexact:", exact, "\nfast:", fast)
assert saved["positions"] == 3 * 31 and saved["ppl"] > 1, "positions or perplexity"
assert exact["positions"] == saved["positions"] and abs(exact["ppl"] - saved["ppl"]) < 1e-9
# Only the 16-bit grid of the stored log-probabilities separates the two.
assert abs(exact["mean_kld"]) < 1e-5 and exact["same_top"] == 1.0, "exact against itself"
# Spec: rounding the activations costs at most 0.01 nats, well below what 4-bit weights
# themselves cost (llama.cpp reports a few hundredths of a nat for its 4-bit formats).
assert 0 <= fast["mean_kld"] <= 0.01, "fast path KL divergence"
PY
out=$("$troupe" perplexity --model "$model" --kl-divergence-base "$source_dir/README.md" 2>&1)
[ $? -ne 0 ] || fail "a text file was taken as a base"
case "$out" in
  *"is not a log-probability file"*) ;;
  *) fail "unexpected error for a text file as the base: $out" ;;
esac
out=$("$troupe" perplexity --model "$model" --file "$source_dir/README.md" --ctx 100000 2>&1)
[ $? -ne 0 ] || fail "a context past the text was accepted"
echo "$out"
