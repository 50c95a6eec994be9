"""Fixtures of the Python package's tests: the C++ suite's tiny models (with
transformers' reference tokens), SmolLM2 from the model cache, and helpers to make
another version of a model's weights."""

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures"


def fixture(name: str) -> str:
    return str(FIXTURES / name)


def reference(name: str) -> dict:
    return json.loads((FIXTURES / name / "reference.json").read_text())


def smollm2_path() -> Path:
    cache = os.environ.get("TROUPE_MODEL_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "troupe", "models")
    return Path(cache) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture
def smollm2() -> str:
    path = smollm2_path()
    if not path.exists():
        pytest.skip(f"{path} is not in the model cache (scripts/fetch-smollm2.sh fetches it)")
    return str(path)


_DTYPES = {"F32": np.float32, "F16": np.float16}


def read_safetensors(path: str) -> dict:
    """The tensors of a safetensors file (F32/F16), as NumPy arrays (copies)."""
    data = Path(path).read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        dtype = _DTYPES[info["dtype"]]
        out[name] = np.frombuffer(data[8 + size + begin : 8 + size + end], dtype=dtype).reshape(
            info["shape"]).copy()
    return out


def write_safetensors(path: str, tensors: dict) -> None:
    names = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}
    header = {}
    blobs = []
    offset = 0
    for name, array in tensors.items():
        raw = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": names[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def perturbed(tensors: dict, seed: int) -> dict:
    """Another version of the weights: each moved by noise of its own size."""
    rng = np.random.default_rng(seed)
    return {name: (t + rng.standard_normal(t.shape).astype(t.dtype) * (np.abs(t).mean() + 0.02))
            for name, t in tensors.items()}


@pytest.fixture
def other_model(tmp_path):
    """A directory with `name`'s config and perturbed weights; returns (path, weights)."""

    def make(name: str, seed: int = 1):
        weights = perturbed(read_safetensors(fixture(name) + "/model.safetensors"), seed)
        (tmp_path / "config.json").write_text((FIXTURES / name / "config.json").read_text())
        write_safetensors(str(tmp_path / "model.safetensors"), weights)
        return str(tmp_path), weights

    return make


def first_logprob(prompt: dict) -> float:
    """transformers' logprob of the first greedy token after a reference prompt."""
    logits = np.asarray(prompt["last_logits"], dtype=np.float64)
    top = logits.max()
    return float(logits[prompt["greedy"][0]] - top - np.log(np.exp(logits - top).sum()))
