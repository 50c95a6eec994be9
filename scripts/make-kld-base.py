#!/usr/bin/env python3
"""Writes the reference next-token distributions of a GGUF model as transformers computes
them, in float32 on the file's weights dequantized (transformers' own GGUF loader, gguf-py's
dequantizers), in llama.cpp's log-probability file, so that `troupe perplexity
--kl-divergence-base` and `llama-perplexity --kl-divergence-base … --kl-divergence` measure
themselves against the same reference.

    python3 scripts/make-kld-base.py MODEL.gguf --tokens-from RUN.kld --out REF.kld

The context, chunks and tokens come from RUN.kld, a file `troupe perplexity --save-logits`
wrote (its chunks already start with the model's BOS token where the model adds one), and
are used as they are. Needs torch, transformers, gguf and numpy (PyPI)."""
import argparse
import os
import struct

import numpy as np
import torch
from transformers import AutoModelForCausalLM


def read_header(path):
    with open(path, "rb") as f:
        if f.read(8) != b"_logits_":
            raise SystemExit(f"{path}: not a log-probability file")
        ctx, vocab, chunks = struct.unpack("<Iii", f.read(12))
        tokens = np.frombuffer(f.read(4 * ctx * chunks), dtype=np.int32)
        if tokens.size != ctx * chunks:
            raise SystemExit(f"{path}: ends before its tokens")
    return ctx, vocab, chunks, tokens


def stored_rows(logits, vocab):
    """llama.cpp's rows: a scale and the smallest log-probability (two float32 in four
    uint16), then each log-probability on a 16-bit grid from the largest down to 16 below
    it, padded to an even count."""
    width = 2 * ((vocab + 1) // 2) + 4
    rows = np.zeros((logits.shape[0], width), dtype=np.uint16)
    for i, row in enumerate(logits):
        top = np.float32(row.max())
        low = np.float32(max(row.min(), top - 16))
        log_sum = np.float32(np.log(np.exp((row - top).astype(np.float64)).sum()))
        min_log_prob = np.float32(low - top - log_sum)
        scale = np.float32((top - low) / np.float32(65535))
        rows[i, :4] = np.frombuffer(struct.pack("<ff", scale, min_log_prob), dtype=np.uint16)
        if scale > 0:
            q = np.rint((row - low) / scale)
            rows[i, 4:4 + vocab] = np.where(row > low, q, 0).astype(np.uint16)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="GGUF file")
    ap.add_argument("--tokens-from", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    ctx, vocab, chunks, tokens = read_header(a.tokens_from)
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(os.path.abspath(a.model)), gguf_file=os.path.basename(a.model),
        torch_dtype=torch.float32)
    model.eval()
    if model.config.vocab_size != vocab:
        raise SystemExit(f"{a.tokens_from} has a vocabulary of {vocab}, the model "
                         f"{model.config.vocab_size}")
    first = ctx // 2
    with open(a.out, "wb") as out:
        out.write(b"_logits_" + struct.pack("<Iii", ctx, vocab, chunks))
        out.write(tokens.astype(np.int32).tobytes())
        for c in range(chunks):
            ids = torch.tensor(tokens[c * ctx:(c + 1) * ctx], dtype=torch.long)[None]
            with torch.no_grad():
                logits = model(ids).logits[0, first:ctx - 1].float().numpy()
            out.write(stored_rows(logits, vocab).tobytes())
            print(f"chunk {c + 1}/{chunks}", flush=True)


if __name__ == "__main__":
    main()
