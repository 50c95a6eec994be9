#!/usr/bin/env python3
"""Writes tests/fixtures/llama-k-gguf: a tiny llama whose rows are whole k-quant super-blocks
(256), quantized by llama.cpp itself to Q4_K_M (Q4_K and Q6_K tensors), Q5_K_M (Q5_K and
Q6_K) and Q6_K, and transformers' outputs on each file (gguf-py dequantizes them): two
independent readings of the k-quant layouts for troupe's to match. CI only reads the
committed files. Needs torch, transformers, gguf, and llama-cpp-python (which builds
llama.cpp) in the Python that runs it, or in the one $LLAMA_CPP_PYTHON names:

    pip install torch transformers gguf llama-cpp-python
    python3 scripts/make-kquant-fixtures.py
"""
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import gguf
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from fixture_lib import reference_runs, write_gguf

out = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "llama-k-gguf"
out.mkdir(parents=True, exist_ok=True)

# llama.cpp's file types (llama.h): the mixes published GGUF files mostly use.
FILE_TYPES = {"q4_k_m": 15, "q5_k_m": 17, "q6_k": 18}

QUANTIZE = """
import sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = int(sys.argv[3])
if llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params) != 0:
    sys.exit("llama.cpp could not quantize " + sys.argv[1])
"""

torch.manual_seed(4321)
config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512,
                     num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
                     bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                     torch_dtype="float32")
model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
with torch.no_grad():
    for name, p in model.named_parameters():
        if "norm" in name:
            p.add_(torch.randn_like(p) * 0.1)
reference = {}
with tempfile.TemporaryDirectory() as tmp:
    model.save_pretrained(tmp, safe_serialization=True)
    f32 = pathlib.Path(tmp) / "llama-k-f32.gguf"
    write_gguf(tmp, f32, gguf.GGMLQuantizationType.F32)
    python = os.environ.get("LLAMA_CPP_PYTHON", sys.executable)
    for name, ftype in FILE_TYPES.items():
        path = out / f"llama-k-{name}.gguf"
        subprocess.run([python, "-c", QUANTIZE, str(f32), str(path), str(ftype)], check=True)
        types = sorted({t.tensor_type.name for t in gguf.GGUFReader(path).tensors})
        quantized = AutoModelForCausalLM.from_pretrained(str(out), gguf_file=path.name,
                                                         torch_dtype=torch.float32).eval()
        reference[name] = {"tensor_types": types, "runs": reference_runs(quantized)}
        print("wrote", path, types)
with open(out / "reference.json", "w") as f:
    json.dump(reference, f)
