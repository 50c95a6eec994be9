#!/usr/bin/env python3
"""Writes the reference fixtures the C++ tests compare against, with independent
implementations (PyTorch and the safetensors package). CI only reads the committed files;
run this again after changing what it writes:

    pip install torch safetensors
    python3 scripts/make-reference-fixtures.py
"""
import pathlib

import torch
from safetensors.torch import save_file

out = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures"
out.mkdir(parents=True, exist_ok=True)

# Element types: every value as the other library stores it, and the float32 it means.
tensors = {
    "a.f32": torch.arange(6, dtype=torch.float32).reshape(2, 3) - 2.5,
    "b.f16": torch.tensor([-2.5, 0.1, 65504.0, 1e-7, -0.0, 3.14159], dtype=torch.float16),
    "c.bf16": torch.tensor([[1.5, -3.14159], [1e30, -1e-30]], dtype=torch.bfloat16),
    "d.empty": torch.zeros((0, 4), dtype=torch.float32),
}
save_file(tensors, str(out / "dtypes.safetensors"), metadata={"format": "pt", "source": "torch"})
with open(out / "dtypes.expected.txt", "w") as f:
    f.write("# name dtype shape : values as float32 (repr), from torch\n")
    for name, t in tensors.items():
        values = " ".join(repr(float(v)) for v in t.to(torch.float32).flatten().tolist())
        shape = "x".join(str(d) for d in t.shape)
        f.write(f"{name} {str(t.dtype).removeprefix('torch.')} {shape} : {values}\n")
print("wrote", out / "dtypes.safetensors")
