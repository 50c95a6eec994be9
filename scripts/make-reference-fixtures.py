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


# -- tiny random-weight models and their outputs, from transformers ---------------------
import json

from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from fixture_lib import reference_runs, tiny_random_model


def tiny_models():
    common = dict(vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-5,
                  bos_token_id=1, eos_token_id=2, torch_dtype="float32")
    yield "llama-gqa", LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   rope_theta=10000.0, tie_word_embeddings=False, **common)
    yield "llama3-rope-tied", LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        **common)
    yield "qwen2-bias", Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2,
                                    rope_theta=1000000.0, tie_word_embeddings=False,
                                    use_sliding_window=False, **common)
    # The rope scalings vLLM runs besides llama3. dynamic's max_position_embeddings is
    # short, so that generation runs past it and the base grows with the length.
    yield "llama-rope-linear", LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "linear", "factor": 2.0}, **common)
    yield "llama-rope-dynamic", LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0},
        **{**common, "max_position_embeddings": 24})
    yield "llama-rope-yarn", LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
        **common)
    # Mistral's sliding window, short enough that the prompts and their continuations
    # slide past it.
    yield "mistral-window", MistralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=False,
        sliding_window=6, **common)
    # Qwen2's window when on: only the layers from max_window_layers on slide.
    yield "qwen2-window", Qwen2Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=False,
        use_sliding_window=True, sliding_window=5, max_window_layers=1, **common)
    # Llama's attention_bias (q, k, v and o) and mlp_bias (gate, up, down).
    yield "llama-bias", LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=False,
        attention_bias=True, mlp_bias=True, **common)
    yield "llama-odd-heads", LlamaConfig(hidden_size=48, intermediate_size=80,
                                         num_hidden_layers=3, num_attention_heads=3,
                                         num_key_value_heads=1, head_dim=16,
                                         tie_word_embeddings=False, **common)


for name, config in tiny_models():
    model = tiny_random_model(config)
    directory = out / name
    model.save_pretrained(directory, safe_serialization=True)
    if name == "qwen2-window":
        # As published Qwen2 configs are: no layer_types, which then come from
        # max_window_layers (transformers computes the same list on loading).
        saved = json.loads((directory / "config.json").read_text())
        del saved["layer_types"]
        (directory / "config.json").write_text(json.dumps(saved, indent=2) + "\n")
    reference = {"prompts": reference_runs(model, all_logits_of_first=True)}
    with open(directory / "reference.json", "w") as f:
        json.dump(reference, f)
    print("wrote", directory)


# -- GGUF files of llama-gqa, as llama.cpp's converter writes them --------------------
# Q and K rows are permuted into llama.cpp's interleaved rotary layout; 2-D weights are
# quantized, norms stay F32. The reference outputs come from transformers loading the
# GGUF file itself (it dequantizes and un-permutes on its own).
import gguf

from fixture_lib import write_gguf


gguf_dir = out / "llama-gqa-gguf"
gguf_dir.mkdir(exist_ok=True)
gguf_reference = {}
for qname in ["F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]:
    qtype = getattr(gguf.GGMLQuantizationType, qname)
    path = gguf_dir / f"llama-gqa-{qname.lower()}.gguf"
    write_gguf(out / "llama-gqa", path, qtype)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=path.name,
                                                 torch_dtype=torch.float32).eval()
    gguf_reference[qname] = reference_runs(model)
    print("wrote", path)
with open(gguf_dir / "reference.json", "w") as f:
    json.dump(gguf_reference, f)


# -- a tiny byte-level BPE tokenizer and its encodings, from the tokenizers library -------
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

tok_dir = out / "tiny-tokenizer"
tok_dir.mkdir(exist_ok=True)
corpus = [
    "The quick brown fox jumps over the lazy dog. It's 2024, isn't it?",
    "Grüße aus München! Ça va? naïve café, résumé, façade.",
    "日本語のテキストと中文文本, 한국어 텍스트, русский текст, ελληνικά.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Emoji 😀🎉👍🏽 and symbols ∑∫√ ±×÷ — “quotes” ‘single’ …",
    "   leading spaces, trailing spaces   \n\n\ttabs\tand\r\nwindows lines",
] * 20
bpe = Tokenizer(models.BPE())
bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
bpe.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=420, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                              special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
bpe.train_from_iterator(corpus, trainer)
bpe.save(str(tok_dir / "tokenizer.json"))
samples = corpus[:6] + [
    "",
    " ",
    "a",
    "Hello, world!",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "numbers 1234567890 and 3.14159 and ٣٤٥ and Ⅻ",
    "it's we're they've I'm you'll he'd 'S",
    "mixed\u00a0non-breaking\u2009thin\u3000ideographic spaces",
    "zero\u200bwidth and combining e\u0301 and ﬁ ligature",
    "\x00\x01 control \x7f bytes",
]
with open(tok_dir / "reference.json", "w") as f:
    json.dump([{"text": s, "ids": bpe.encode(s).ids} for s in samples], f, ensure_ascii=False)
print("wrote", tok_dir)
